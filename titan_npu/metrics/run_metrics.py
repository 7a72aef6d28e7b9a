"""Reading a run's metrics.jsonl back: its training and validation records, by step, the newest of a repeated
step winning."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_npu.errors import DataError

METRICS = "metrics.jsonl"


def _number(v: Any) -> Any:
    """metrics.jsonl writes NaN/inf as strings; turn them back into floats."""
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(v)
    return v


@dataclass
class RunMetrics:
    """The records of metrics.jsonl, split into training and validation records, each sorted by step."""

    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0


def _append(records: list[dict[str, Any]], rec: dict[str, Any]) -> None:
    # A run resumed from an older checkpoint (or restarted in the same dir) logs steps again: the newer wins.
    while records and records[-1]["step"] >= rec["step"]:
        records.pop()
    records.append(rec)


def read_metrics(log_dir: str | os.PathLike) -> RunMetrics:
    """Parse <log_dir>/metrics.jsonl; unreadable lines (a crash mid-write) are counted and skipped."""
    path = Path(log_dir) / METRICS
    if not path.is_file():
        where = Path(log_dir)
        what = "does not exist" if not where.exists() else f"has no {METRICS}"
        raise DataError(f"{where} {what}; give the metrics.log_dir of a run (the directory holding {METRICS})")
    run = RunMetrics()
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                run.skipped_lines += 1
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                run.skipped_lines += 1
                continue
            rec = {k: _number(v) for k, v in rec.items()}
            if "val_loss" in rec:
                _append(run.val, rec)
            elif "loss" in rec:
                _append(run.train, rec)
            else:
                run.skipped_lines += 1
    if not run.train and not run.val:
        raise DataError(f"{path} holds no step records; the run logged nothing yet (metrics.log_interval steps "
                        f"must pass before the first line after step 1)")
    return run

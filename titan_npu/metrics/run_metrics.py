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
    evals: list[dict[str, Any]] = field(default_factory=list)  # [eval] records: eval/<task>/<metric>, eval_time_s
    skipped_lines: int = 0
    first_skipped: str = ""  # "metrics.jsonl:LINE: why" of the first skipped line, for the one-line warning

    def skip(self, path: Path, number: int, why: str) -> None:
        """Count line `number` of `path` as unreadable (the first one is remembered with `why`)."""
        self.skipped_lines += 1
        if not self.first_skipped:
            self.first_skipped = f"{path}:{number}: {why}"

    def skipped_warning(self) -> str:
        """One line naming the first skipped line and how many were skipped ('' when none)."""
        if not self.skipped_lines:
            return ""
        return (f"{self.first_skipped}; skipped it ({self.skipped_lines} unreadable line(s) of {METRICS} in all: "
                f"the report leaves them out)")


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
    # Read as bytes and decode line by line: one damaged line (a non-UTF-8 byte, a crash mid-write) is skipped and
    # named, not a traceback or the end of the report.
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                run.skip(path, number, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                run.skip(path, number, "not a JSON record")
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                run.skip(path, number, "not a step record (an object with an integer 'step')")
                continue
            rec = {k: _number(v) for k, v in rec.items()}
            if "val_loss" in rec:
                _append(run.val, rec)
            elif "eval_time_s" in rec:
                _append(run.evals, rec)
            elif "loss" in rec:
                _append(run.train, rec)
            else:
                run.skip(path, number, "a record with neither 'loss' nor 'val_loss'")
    if not run.train and not run.val:
        raise DataError(f"{path} holds no step records; the run logged nothing yet (metrics.log_interval steps "
                        f"must pass before the first line after step 1)")
    return run

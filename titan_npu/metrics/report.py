"""A run's report from its log dir: report.png (plots.py) and report.md (markdown.py), written side by side.

The same function runs on rank 0 at the end of every training run and as `titan-npu report LOG_DIR`. It reads only
files: metrics.jsonl, config.toml and run_info.json (written by the trainer at start-up), and lists the checkpoint
directory if it exists.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_npu.atomic import atomic_write_text
from titan_npu.errors import DataError, TitanError
from titan_npu.metrics.markdown import REPORT_HEADING, render_markdown
from titan_npu.metrics.plots import plot_report, require_matplotlib
from titan_npu.metrics.run_info import read_run_info
from titan_npu.metrics.run_metrics import read_metrics
from titan_npu.outputs import protected_at, run_log_files_ours
from titan_npu.regular_files import read_regular_text

log = logging.getLogger("titan_npu")


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(read_regular_text(path, "utf-8-sig"))  # a byte-order mark is dropped, as the loader does
    except (OSError, ValueError):  # UnicodeDecodeError and TOMLDecodeError are ValueErrors: the report says less
        return {}


def check_report_dir(out: Path) -> None:
    """DataError when writing report.md / report.png into `out` would replace or add to what is not ours: a file
    named like the folder, a report.md written by someone else, or a checkpoint's files."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; name a folder for report.md and report.png")
    found = protected_at(out)
    if found is not None:
        raise DataError(f"--out {out} {found[0]} the {found[1]} {found[2]}; write the report elsewhere")
    md = out / "report.md"
    if md.is_file():
        with open(md, encoding="utf-8", errors="replace") as f:
            ours = f.readline().startswith(REPORT_HEADING)
        if not ours:
            raise DataError(f"--out {out} holds a report.md that titan-npu report did not write; move it away or "
                            "choose another --out")
    elif (out / "report.png").exists() and not run_log_files_ours(out)("report.png"):
        # report.png is ours beside our report.md, or in a run's log dir
        raise DataError(f"--out {out} holds a report.png that titan-npu report did not write; move it away or "
                        "choose another --out")


def write_report(log_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 plots: bool = True, warn: Callable[[str], None] | None = None) -> list[Path]:
    """Write report.png (when matplotlib is there and `plots`) and report.md; returns the files written. `warn`
    (default: the titan_npu logger) gets the one line naming the lines of metrics.jsonl that were skipped."""
    log_dir = Path(log_dir)
    out = Path(out_dir) if out_dir is not None else log_dir
    run = read_metrics(log_dir)
    if run.skipped_lines:
        (warn or log.warning)(f"report: {run.skipped_warning()}")
    config = _read_toml(log_dir / "config.toml")
    info = read_run_info(log_dir)
    check_report_dir(out)
    if plots:
        require_matplotlib()  # before anything is created
    out.mkdir(parents=True, exist_ok=True)
    written = []
    png_name = None
    if plots:
        m = config.get("model", {})
        title = f"{log_dir.resolve().name}: {m.get('name', '')} {m.get('flavor', '')}".strip()
        written.append(plot_report(run, out / "report.png", title=title))
        png_name = "report.png"
    md = render_markdown(log_dir, run, config, info, png_name)
    md_path = out / "report.md"
    atomic_write_text(md_path, md)
    written.append(md_path)
    return written


def final_report(log_dir: str | os.PathLike) -> list[Path]:
    """The end-of-run report on rank 0: never fails the run (no matplotlib -> report.md only, with a warning)."""
    import importlib.util

    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:
        log.warning("matplotlib is not installed (pip install matplotlib): report.md is written without report.png")
    try:
        return write_report(log_dir, plots=plots)
    except (TitanError, OSError) as e:
        log.warning("no report written: %s", e)
        return []

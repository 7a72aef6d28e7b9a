"""`titan-npu report LOG_DIR [--out DIR] [--no-plots]`: plot and summarise a run from its log dir."""

from __future__ import annotations

import sys

from titan_npu.commands.parsing import CommandParser, parse


def build_parser() -> CommandParser:
    p = CommandParser(prog="titan-npu report", description="Plot and summarise a run from its log dir.")
    p.add_argument("log_dir", help="the run's metrics.log_dir (holds metrics.jsonl and config.toml)")
    p.add_argument("--out", help="where to write report.png and report.md (default: LOG_DIR)")
    p.add_argument("--no-plots", action="store_true", help="write report.md only (no matplotlib needed)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu report`."""
    from titan_npu.metrics.report import write_report

    args, _ = parse("report", build_parser(), argv)
    for path in write_report(args.log_dir, args.out, plots=not args.no_plots, warn=_to_stderr):
        print(path)
    return 0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)

"""`titan-npu bench`: train a fixed number of steps through the real Trainer and report speed and memory
(what is measured and how: tools/bench.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

from titan_npu.commands.parsing import CommandParser, parse


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="titan-npu bench",
        description="Train a fixed number of steps through the real trainer and report tokens/s, MFU, step "
        "times and peak memory. Any config key can be overridden as --section.key value.",
    )
    p.add_argument("--config", "--config_file", dest="config", help="TOML or YAML config file (default: all defaults)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (logs go to stderr)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry of `titan-npu bench`."""
    from titan_npu.commands.launch import check_before_process_group, check_launch_env
    from titan_npu.config.loader import load_config
    from titan_npu.errors import TitanError
    from titan_npu.metrics.console import setup_logging
    from titan_npu.tools.bench import format_result, prepare_config, run_bench

    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parse("bench", build_parser(), argv, known=True)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    if args.json:
        for handler in logging.getLogger("titan_npu").handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
    try:  # as train does: a refusal before any process group forms, said once
        check_launch_env()
        cfg = load_config(args.config, overrides)
        check_before_process_group(cfg)
    except TitanError as e:
        e.same_on_every_rank = True
        raise
    explicit_log_dir = any("log_dir" in token for token in overrides)
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as tmp:
        prepare_config(cfg, args.steps, args.warmup, cfg.metrics.log_dir if explicit_log_dir else tmp)
        result = run_bench(cfg, args.steps, args.warmup)
    if rank == 0:
        print(json.dumps(result.to_dict()) if args.json else format_result(result), flush=True)
    return 0

"""`python train.py --config C [--section.key value ...]` and `titan-npu train`: parse, load the config, train."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from titan_npu.commands.parsing import CommandParser, parse

if TYPE_CHECKING:
    from titan_npu.trainer import Trainer


def build_parser() -> CommandParser:
    """train.py's options; the config keys (--section.key value and the short flags) are parsed by the loader."""
    from titan_npu.config.aliases import TOP_LEVEL_ALIASES

    short = [(f"--{alias}", f"--{section}.{key}") for alias, (section, key) in TOP_LEVEL_ALIASES.items()]
    p = CommandParser(
        prog="train.py",
        description="Train a Llama, Qwen or DeepSeek model. Any config key can be overridden as --section.key value; "
        f"{', '.join(a for a, _ in short[:-1])} and {short[-1][0]} are short for "
        f"{', '.join(k for _, k in short[:-1])} and {short[-1][1]}.",
        epilog="example: torchrun --nproc_per_node 4 train.py --config configs/llama_7b.toml --data_dir /data/tokens "
        "--data.tokenizer /models/Llama-2-7b/tokenizer.model",
    )
    p.add_argument("--config", "--config_file", dest="config", help="TOML or YAML config file (default: all defaults)")
    p.add_argument("--print_config", "--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="build one rank of the job on the meta device (no devices) and report what it holds")
    p.add_argument("--world-size", "--world_size", dest="world_size", type=int,
                   help="--dry-run: ranks of the job (default: WORLD_SIZE, else the config's degrees)")
    p.add_argument("--rank", type=int, default=0, help="--dry-run: the rank to build (default 0)")
    p.add_argument("--device-type", "--device_type", dest="device_type", default="npu",
                   help="--dry-run: device type the job runs on (npu, cuda, cpu; default npu)")
    return p


def main(argv: list[str] | None = None, setup: Callable[[Trainer], None] | None = None) -> int:
    """Entry of `titan-npu train` and of train.py; `setup` is called with the Trainer before training (hooks)."""
    from titan_npu.commands.launch import check_before_process_group, check_launch_env, set_launch_env
    from titan_npu.config.loader import config_to_dict, load_config
    from titan_npu.errors import TitanError
    from titan_npu.metrics.console import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parse("train", build_parser(), argv, known=True)
    setup_logging(_rank())
    try:
        if not args.print_config:
            check_launch_env()
        if not (args.print_config or args.dry_run):
            set_launch_env(load_config(args.config, overrides, model=False))  # reads no [model]: imports no torch
        cfg = load_config(args.config, overrides)
        if not args.print_config and not args.dry_run:
            check_before_process_group(cfg)
    except (TitanError, OSError) as e:
        e.same_on_every_rank = True  # found before any process group: every rank sees it, rank 0 says it
        raise
    if args.print_config:
        import json

        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    if args.dry_run:
        from titan_npu.planner import dry_run
        from titan_npu.reliability.dirs import check_output_contents

        check_output_contents(cfg)  # the refusals the run would give its folders

        world = args.world_size or (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
        return dry_run.run(cfg, world, args.rank, args.device_type)

    from titan_npu.parallel.process_group import lost_rank_error
    from titan_npu.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg)
        if setup is not None:
            setup(trainer)
        trainer.train()
    except BaseException as e:  # a peer rank that ended takes this one down (also inside a DCP save): say which
        where = f"at step {trainer.step}" if trainer is not None and trainer.step else "while the run started"
        lost = lost_rank_error(e, where)
        if lost is None:
            raise
        raise lost from e
    finally:
        if trainer is not None:
            trainer.close()
    return 0


def _rank() -> int:
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


def cli_main() -> None:
    """train.py's entry: the same one-line error handling and exit as `titan-npu`."""
    from titan_npu.cli import run_as_process, run_command

    run_as_process(lambda: run_command(main, sys.argv[1:]))

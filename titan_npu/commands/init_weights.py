"""`titan-npu init-weights`: write a config's initial weights as a checkpoint that any layout starts from."""

from __future__ import annotations

from titan_npu.commands.parsing import CommandParser, parse


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="titan-npu init-weights",
        description="Write the initial weights a config gives (its [model] and training.seed) as a checkpoint "
                    "directory that any parallel layout starts from with checkpoint.initial_load. Any config key "
                    "can be overridden as --section.key value; under torchrun every rank writes its own shard.",
        epilog="example: titan-npu init-weights --config configs/llama3_8b.toml --output seeds/llama3_8b",
    )
    p.add_argument("--config", "--config_file", dest="config", help="TOML or YAML config file (default: all defaults)")
    p.add_argument("--output", required=True, help="the checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu init-weights`."""
    import os

    from titan_npu.checkpoint.seed import create_seed_checkpoint
    from titan_npu.commands.launch import check_launch_env
    from titan_npu.config.loader import load_config
    from titan_npu.metrics.console import setup_logging

    args, overrides = parse("init-weights", build_parser(), argv, known=True)
    check_launch_env()
    setup_logging(int(os.environ.get("RANK", "0")))
    cfg = load_config(args.config, overrides)
    n_params = create_seed_checkpoint(cfg, args.output, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote the initial weights of training.seed={cfg.training.seed} ({n_params / 1e6:.1f}M parameters) "
              f"to {args.output}; start any layout from them with checkpoint.initial_load={args.output}")
    return 0

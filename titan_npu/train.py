"""`python train.py --config C [--section.key value ...]`: parse, load the config, train."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig
    from titan_npu.trainer import Trainer

log = logging.getLogger("titan_npu")


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; other ranks only warnings, prefixed with their rank."""
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if rank == 0 else f"[rank{rank}] "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    root = logging.getLogger("titan_npu")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def build_parser() -> argparse.ArgumentParser:
    """train.py's options; the config keys (--section.key value and the short flags) are parsed by the loader."""
    from titan_npu.config.aliases import TOP_LEVEL_ALIASES

    short = [(f"--{alias}", f"--{section}.{key}") for alias, (section, key) in TOP_LEVEL_ALIASES.items()]
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a Llama, Qwen or DeepSeek model. Any config key can be overridden as --section.key value; "
        f"{', '.join(a for a, _ in short[:-1])} and {short[-1][0]} are short for "
        f"{', '.join(k for _, k in short[:-1])} and {short[-1][1]}.",
        epilog="example: torchrun --nproc_per_node 4 train.py --config configs/llama_7b.toml --data_dir /data/tokens "
        "--data.tokenizer /models/llama2/tokenizer.model",
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
    from titan_npu.config.loader import config_to_dict, load_config
    from titan_npu.errors import TitanError

    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = build_parser().parse_known_args(argv)
    setup_logging(_rank())
    try:
        if not (args.print_config or args.dry_run):
            set_launch_env(load_config(args.config, overrides, model=False))  # reads no [model]: imports no torch
        cfg = load_config(args.config, overrides)
    except TitanError as e:
        e.same_on_every_rank = True  # found before any process group: every rank sees it, rank 0 says it
        raise
    if not args.print_config:
        preflight(cfg, before_process_group=not args.dry_run)
    if args.print_config:
        import json

        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0
    if args.dry_run:
        from titan_npu.planner import dry_run

        world = args.world_size or (int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
        return dry_run.run(cfg, world, args.rank, args.device_type)

    from titan_npu.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        if setup is not None:
            setup(trainer)
        trainer.train()
    finally:
        trainer.close()
    return 0


def set_launch_env(cfg: JobConfig) -> dict[str, str]:
    """Before torch is imported: on an NPU run, the variables torch_npu reads at import and at device start
    (device/env.py) and the flight recorder's (reliability/watchdog.py), from the config; returns what was set.

    torch_npu registers a torch.backends entry point, so `import torch` imports it, and it reads
    TORCH_HCCL_TRACE_BUFFER_SIZE and TASK_QUEUE_ENABLE right then (its _init/core/optional_features.py): nothing may
    import torch before this runs. The environment's own values win; the Trainer sets the rest before the device is
    bound (setup_device).
    """
    from titan_npu.device.env import apply_communication_env, npu_expected
    from titan_npu.device.npu import check_installed_versions
    from titan_npu.reliability.watchdog import enable_flight_recorder

    if not npu_expected(cfg.parallel.backend):
        return {}
    check_installed_versions()  # a mismatched pair would fail inside `import torch`, which imports torch_npu
    t = cfg.training
    env = apply_communication_env("npu", cfg.comm, t.deterministic, t.npu_task_queue)
    if cfg.reliability.watchdog:
        env.update((name, os.environ[name]) for name in enable_flight_recorder(cfg.reliability.flight_recorder_size,
                                                                               "npu"))
    return env


def _rank() -> int:
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


def preflight(cfg: JobConfig, before_process_group: bool = True) -> None:
    """The launch environment and (unless before_process_group is False: the dry run) the checks that need no
    process group; a refusal is marked as every rank's (each finds it before any process group: rank 0 says it)."""
    from titan_npu.errors import TitanError

    try:
        check_launch_env()
        if before_process_group:
            check_before_process_group(cfg)
    except TitanError as e:
        e.same_on_every_rank = True
        raise


def check_launch_env() -> None:
    """DeviceError naming the variable when the launcher's environment cannot describe a rank of a job:
    WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE not whole numbers (or WORLD_SIZE < 1), a rank outside the world,
    MASTER_PORT not a port."""
    from titan_npu.errors import DeviceError

    env = os.environ
    fix = "launch with torchrun (it sets them), or unset them for one process"
    counts = {}
    for name, least in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        if name in env:
            value = env[name].strip()
            if not value.isdigit() or int(value) < least:
                raise DeviceError(f"{name}={env[name]!r} is not a whole number >= {least}; {fix}")
            counts[name] = int(value)
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in counts and size in counts and counts[rank] >= counts[size]:
            raise DeviceError(f"{rank}={counts[rank]} is not below {size}={counts[size]}; {fix}")
    port = env.get("MASTER_PORT")
    if port is not None and (not port.strip().isdigit() or not 1 <= int(port) <= 65535):
        raise DeviceError(f"MASTER_PORT={port!r} is not a port (1-65535); choose a free port, e.g. 29500")


def check_before_process_group(cfg: JobConfig) -> None:
    """The checks that need no process group, made by every rank before one forms (so a refusal costs no
    rendezvous, no device mesh and no collective timeout): the layout against WORLD_SIZE, the model's shapes,
    seq_len against them, and the tokenizer against the vocabulary. Call it after check_launch_env."""
    from titan_npu.config.validate import check_seq_len
    from titan_npu.data.tokenizer import build_tokenizer, check_vocab
    from titan_npu.models.registry import build_model_args
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.layout import validate_layout

    model_args = build_model_args(cfg.model)
    validate_layout(ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1"))), model_args, cfg)
    check_seq_len(cfg.training.seq_len, model_args.max_seq_len)
    check_vocab(build_tokenizer(cfg.data.tokenizer), model_args.vocab_size)


def cli_main() -> None:
    """train.py's entry: the same one-line error handling and exit as `titan-npu`."""
    from titan_npu.cli import run_as_process, run_command

    run_as_process(lambda: run_command(main, sys.argv[1:]))

"""What every rank checks before a process group forms: the launcher's environment (before the config is read)
and the layout, shapes and tokenizer the config asks for, so that a refusal costs no rendezvous, no device mesh and
no collective timeout. Every rank finds such a refusal alike: the commands mark it `same_on_every_rank`, and rank 0
says it."""

from __future__ import annotations

import os
from collections.abc import Mapping

from titan_npu.config.schema import JobConfig


def check_launch_env() -> None:
    """DeviceError naming the variable when the launcher's environment cannot describe a rank of a job:
    WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE not whole numbers (or WORLD_SIZE < 1), a rank outside the world,
    MASTER_PORT not a port, or a variable missing that the others imply (LAUNCH_VARS)."""
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
    missing = missing_launch_var(env)
    if missing is not None:
        given, absent = missing
        raise DeviceError(f"{given}={env[given]} but {absent} is not set; {fix}")


# What torchrun sets for every worker: a rank of a job needs its rank, the job's size and its place on the node; a
# job of more than one process also needs the address of its rendezvous.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")


def missing_launch_var(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(a variable that is set, one it implies that is not) of a partial launch environment; None when the
    environment is whole or holds none of them. A lone WORLD_SIZE=1 is one process and needs nothing more."""
    present = [name for name in (*RANK_VARS, *RENDEZVOUS_VARS) if name in env]
    if not present or present == ["WORLD_SIZE"] and env["WORLD_SIZE"].strip() == "1":
        return None
    for name in RANK_VARS:
        if name not in env:
            return present[0], name
    if env["WORLD_SIZE"].strip() != "1":
        for name in RENDEZVOUS_VARS:
            if name not in env:
                return "WORLD_SIZE", name
    return None


def check_before_process_group(cfg: JobConfig) -> None:
    """The checks that need no process group, made by every rank before one forms (so a refusal costs no
    rendezvous, no device mesh and no collective timeout): the layout against WORLD_SIZE, the model's shapes,
    seq_len against them, the tokenizer against the vocabulary, and each source of a data mixture. Call it after
    check_launch_env."""
    from titan_npu.config.validate import check_seq_len
    from titan_npu.data.tokenizer import build_tokenizer, check_vocab
    from titan_npu.models.registry import build_model_args
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.layout import validate_layout

    model_args = build_model_args(cfg.model)
    validate_layout(ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1"))), model_args, cfg)
    check_seq_len(cfg.training.seq_len, model_args.max_seq_len)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, model_args.vocab_size)
    if len(cfg.data.sources) > 1:  # every source of a mixture: there, the run's tokenizer, one window of data
        from titan_npu.data.loader import open_sources

        open_sources(cfg, tokenizer, model_args.vocab_size)


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

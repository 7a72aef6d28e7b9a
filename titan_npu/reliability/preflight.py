"""Checks that refuse a run before it starts: settings no device or run can use, with the fix in the message."""

from __future__ import annotations

import logging
import os

import torch

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError

log = logging.getLogger("titan_npu")


def check_dtype_support(dtype: str, device_type: str) -> None:
    """ConfigError when training.dtype has no fast kernels on this device (a run would crawl or fail much later)."""
    if dtype == "fp16" and device_type == "cpu":
        raise ConfigError(
            "training.dtype = fp16 on a CPU: CPUs have no fast fp16 matrix multiply (a step runs orders of magnitude "
            "slower than fp32); use training.dtype = fp32 (or bf16) on CPU, fp16 on an NPU or GPU"
        )
    if dtype == "bf16" and device_type != "cpu":
        module = getattr(torch, device_type, None)
        supported = getattr(module, "is_bf16_supported", None)
        if supported is not None and not supported():
            raise ConfigError(
                f"training.dtype = bf16 but this {device_type} device has no bf16 support; "
                "use training.dtype = fp16 (with loss scaling) or fp32"
            )


def restart_problem(env: dict[str, str] | os._Environ = os.environ) -> str:
    """Why torchrun's restarts could fail to re-form the process group here ("" when they will not)."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    nodes = env.get("GROUP_WORLD_SIZE", "1").strip()
    if (not restarts.isdigit() or int(restarts) == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or not nodes.isdigit() or int(nodes) < 2):
        return ""
    # The process group's keys in torchrun's shared store are scoped by TORCHELASTIC_RESTART_COUNT. On one node that
    # is the same for every rank; across nodes a restart that a node's arrival causes is not counted on the others.
    return (f"torchrun --max-restarts {restarts} on {nodes} nodes shares its rendezvous store with the workers, and "
            "a restart caused by a node joining is not counted on every node, so the ranks could look for each "
            "other under different restart counts; with --rdzv-backend c10d export "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (as examples/restart_multi_node.sh does)")


def preflight(cfg: JobConfig, device_type: str) -> None:
    """Every check of this module for one run on `device_type`."""
    check_dtype_support(cfg.training.dtype, device_type)
    problem = restart_problem()
    if problem and os.environ.get("RANK", "0") == "0":
        log.warning("restarts: %s", problem)

"""Training dtypes: names to torch dtypes, the autocast context and the loss scaler for fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_torch_dtype(name: str) -> torch.dtype:
    """'bf16' -> torch.bfloat16 and so on."""
    return DTYPES[name]


def autocast_context(
    device_type: str, dtype_name: str, sharded_mixed_precision: bool
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward's precision context: autocast for bf16/fp16 unless FSDP already casts the params."""
    if dtype_name == "fp32" or sharded_mixed_precision:
        return contextlib.nullcontext
    dtype = to_torch_dtype(dtype_name)
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


def build_grad_scaler(device_type: str, dtype_name: str, sharded: bool):
    """A loss scaler for fp16 (the sharded one under FSDP), None for bf16/fp32 which need none."""
    if dtype_name != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type)
    return torch.amp.GradScaler(device_type)

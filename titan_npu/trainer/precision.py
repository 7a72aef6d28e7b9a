"""Training dtypes: names to torch dtypes, the autocast context and the loss scaler for fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from titan_npu.device.dtypes import DTYPES, to_torch_dtype
from titan_npu.errors import ConfigError

__all__ = ["DTYPES", "autocast_context", "build_grad_scaler", "pure_param_dtype", "set_fp32_matmul_precision",
           "to_torch_dtype"]


def pure_param_dtype(dtype_name: str, mixed_precision: bool) -> torch.dtype | None:
    """The dtype parameters are stored in for training.mixed_precision = false (pure bf16), None when mixed."""
    if mixed_precision or dtype_name == "fp32":
        return None
    if dtype_name != "bf16":
        # fp16 without fp32 master weights loses small updates outright, and the loss scaler refuses fp16 gradients.
        raise ConfigError(
            f"training.mixed_precision=false needs training.dtype=bf16 (got {dtype_name}); "
            f"use bf16, or keep mixed_precision=true for fp16"
        )
    return to_torch_dtype(dtype_name)


def set_fp32_matmul_precision(device_type: str, tf32: bool, deterministic: bool) -> bool:
    """On CUDA, let fp32 matmuls run on TF32 tensor cores (training.tf32, never when deterministic); returns
    whether they do, which decides the peak an fp32 run's MFU is scored against."""
    if device_type != "cuda":
        return False
    enabled = tf32 and not deterministic
    torch.backends.cuda.matmul.fp32_precision = "tf32" if enabled else "ieee"
    return enabled


def autocast_context(
    device_type: str, dtype_name: str, sharded_mixed_precision: bool, pure: bool = False
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward's precision context: autocast for bf16/fp16 unless the parameters are already in
    the compute dtype (FSDP casts them, or pure bf16 stores them so)."""
    if dtype_name == "fp32" or sharded_mixed_precision or pure:
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

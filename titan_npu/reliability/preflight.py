"""Checks that refuse a run before it starts: settings no device or run can use, with the fix in the message."""

from __future__ import annotations

import torch

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError
from titan_npu.reliability.settings import check_reliability_config


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


def preflight(cfg: JobConfig, device_type: str) -> None:
    """Every check of this module for one run on `device_type`."""
    check_reliability_config(cfg)
    check_dtype_support(cfg.training.dtype, device_type)

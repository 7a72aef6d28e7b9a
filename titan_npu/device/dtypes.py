"""The training dtypes' names (training.dtype) and their torch dtypes."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_torch_dtype(name: str) -> torch.dtype:
    """'bf16' -> torch.bfloat16 and so on."""
    return DTYPES[name]

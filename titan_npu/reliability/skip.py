"""Skipping an optimizer update on a flag that stays on the device, so that the step never waits for the host.

torch's fused Adam, AdamW and SGD take a `found_inf` tensor (the loss scaler's overflow flag): at 1.0 the kernel
leaves parameters, moments and step counts exactly as they were (on NPU through the _fused_adamw_ kernel that
torch_npu registers). The other implementations (foreach, for-loop) cannot: for them the flag is read on the host
before the update.
"""

from __future__ import annotations

import torch


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers behind `optimizer` (one per pipeline model part, or itself)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def takes_device_flag(optimizer: torch.optim.Optimizer) -> bool:
    """True when every optimizer behind `optimizer` can skip its update on a device flag (torch's fused kernels)."""
    return all(getattr(opt, "_step_supports_amp_scaling", False) for opt in inner_optimizers(optimizer))


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step(), a no-op where the 0-d float tensor `skip` is 1.0 (decided on the device, never read)."""
    opts = inner_optimizers(optimizer)
    for opt in opts:
        opt.found_inf = skip
    try:
        optimizer.step()
    finally:
        for opt in opts:
            del opt.found_inf

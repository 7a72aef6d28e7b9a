"""torch_npu.optim of the fake: NpuFusedAdamW with torch.optim.AdamW's update rule (the real one fuses the tensors)."""

from __future__ import annotations

import torch


class NpuFusedAdamW(torch.optim.AdamW):
    """AdamW with the signature and defaults of torch_npu.optim.NpuFusedAdamW."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=False)

"""A linear layer with a low-rank adapter: y = base(x) + scaling * B(A(dropout(x))).

The adapter joins the linear in place: its class becomes a subclass of its own class (the base forward, kernel and
bias unchanged) and it gains the parameters lora_A [r, in] and lora_B [out, r], so the frozen weight keeps its
name (checkpoints, Hugging Face import and the tensor-parallel plans see the model they know). A starts from
N(0, 1/r^2) (peft's "gaussian" init), B from zeros: the adapted model starts as the base model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from titan_npu.models.init import ParamInit, constant, normal


class LoRAMixin:
    """The adapter's forward and its parameters' initial distributions; mixed into the adapted linear's class."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_rank: int
    lora_scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base linear's output plus the scaled low-rank update of (dropped-out) x."""
        out = super().forward(x)  # type: ignore[misc]
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x  # type: ignore[attr-defined]
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.lora_scaling

    def attached_param_inits(self) -> dict[str, ParamInit]:
        """A ~ N(0, 1/r^2), B = 0 (the update starts at zero)."""
        return {"lora_A": normal(1.0 / self.lora_rank), "lora_B": constant(0.0)}


@functools.cache
def lora_class(base: type) -> type:
    """The adapted class of a linear class (one per base class, so isinstance and pickling stay stable)."""
    return type(f"LoRA{base.__name__}", (LoRAMixin, base), {})


def add_adapter(linear: nn.Linear, rank: int, scaling: float, dropout: float) -> None:
    """Give `linear` (on any device, meta included) an adapter of rank `rank`; the caller freezes the base."""
    weight = linear.weight
    linear.__class__ = lora_class(type(linear))
    linear.lora_rank, linear.lora_scaling, linear.lora_dropout = rank, scaling, dropout
    out_features, in_features = weight.shape
    linear.lora_A = nn.Parameter(torch.empty(rank, in_features, device=weight.device, dtype=weight.dtype))
    linear.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=weight.device, dtype=weight.dtype))


def is_adapted(module: nn.Module) -> bool:
    """Whether `module` carries an adapter."""
    return isinstance(module, LoRAMixin)

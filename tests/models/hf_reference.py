"""Helpers the model-family tests share to hold a model to its Hugging Face reference."""

from __future__ import annotations

import torch


def randomise(model: torch.nn.Module, seed: int, scale: float = 0.08, norm_scale: float = 0.2) -> None:
    """Weights well away from init, norms (and biases) included, so a wrongly mapped tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + norm_scale * noise if "norm" in name else scale * noise)


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ours or of a transformers model, without gradients."""
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out

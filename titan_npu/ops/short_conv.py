"""The short causal depthwise convolution before a linear-attention layer's q / k / v, with document resets."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """silu of x [B, S, C] convolved per channel with weight [C, K] over the position and the K - 1 before it
    (transformers' causal_conv1d_fn); segments [B, S] (a document index per position): a position sees only the
    earlier positions of its own document, as if each document were run alone."""
    seqlen, width = x.shape[1], weight.shape[1]
    if segments is None:
        out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=width - 1, groups=x.shape[2])
        return F.silu(out[..., :seqlen]).transpose(1, 2)
    out = x * weight[:, -1]
    for shift in range(1, min(width, seqlen)):
        earlier = F.pad(x, (0, 0, shift, 0))[:, :seqlen]
        same = segments == F.pad(segments, (shift, 0), value=-1)[:, :seqlen]
        out = out + earlier * same[..., None] * weight[:, -1 - shift]
    return F.silu(out)

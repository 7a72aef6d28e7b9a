"""The training loss of one micro-batch: the model's forward and the mean next-token cross entropy, chunked or whole.

The cross entropy itself, chunked over tokens so that the logits are never whole, is an op (ops/cross_entropy.py);
here is the choice between the two paths a run takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from titan_npu.ops.cross_entropy import IGNORE_INDEX, chunked_linear_cross_entropy, cross_entropy_loss
from titan_npu.ops.documents import Documents

__all__ = ["IGNORE_INDEX", "chunked_linear_cross_entropy", "cross_entropy_loss", "model_loss"]


def model_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
               autocast: Callable[[], contextlib.AbstractContextManager], chunk_tokens: int,
               documents: Documents | None = None) -> torch.Tensor:
    """Forward of one micro-batch and its mean cross entropy: chunked inside the model's forward when chunk_tokens
    > 0 (loss_chunk_tokens), else from the whole logits. documents: the batch's (data.document_mask)."""
    kwargs = {} if documents is None else {"documents": documents}
    with autocast():
        if chunk_tokens > 0:
            return model(inputs, labels=labels, loss_chunk_tokens=chunk_tokens, **kwargs)
        logits = model(inputs, **kwargs)
    return cross_entropy_loss(logits, labels)


"""The training loss: each micro-batch's forward and cross entropy, weighted so that the step's loss is the mean over
the valid (not IGNORE_INDEX) labels of the whole global batch.

The cross entropy itself, chunked over tokens so that the logits are never whole, is an op (ops/cross_entropy.py);
here is the choice between the two paths a run takes, and the weights.

A micro-batch's loss is the mean over its own valid labels. With every label valid and equal micro-batches that is
already a share of the step's mean; with labels masked (supervised fine-tuning: -100 outside the assistant turns) a
mean of per-micro-batch means would weight a token of a sparse micro-batch more than one of a dense micro-batch. So
each micro-batch's mean is multiplied by count x share / global_count (token_weight): count its valid labels (on
this rank: under context parallelism its local share), global_count those of the step summed over every micro-batch
and every rank that holds different tokens (data parallel x context parallel: one all-reduce of a host count per
step, reduce.global_token_count), share the number of terms the step averages (micro-batches x those ranks: the
trainer's 1/accum or the pipeline schedule's 1/n_microbatches, and the gradient reduce's mean). The sum of all of
it is sum(CE over valid labels of the global batch) / global_count. With every label valid the weight is exactly 1
(count x share = global_count as integers), so pretraining's arithmetic is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from titan_npu.ops.cross_entropy import IGNORE_INDEX, chunked_linear_cross_entropy, cross_entropy_loss
from titan_npu.ops.documents import Documents
from titan_npu.parallel.reduce import in_loss_form

__all__ = ["IGNORE_INDEX", "chunked_linear_cross_entropy", "cross_entropy_loss", "model_loss", "stand_in_labels",
           "token_weight", "token_weighted_loss", "valid_labels"]


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


def valid_labels(labels: torch.Tensor) -> int:
    """How many of host `labels` (the loader's, before they move to the device) the loss counts (not IGNORE_INDEX):
    reading the count waits for no device. A device tensor is refused: its count would be a read-back."""
    if labels.device.type != "cpu":
        raise ValueError(f"valid_labels counts host labels; these are on {labels.device}")
    return int((labels != IGNORE_INDEX).sum())


def token_weight(count: int, share: int, global_count: int) -> float:
    """The weight of a micro-batch's mean loss over its `count` valid labels: count x share / global_count (module
    docstring); exactly 1.0 when count x share == global_count, 0 when the step has no valid label."""
    return count * share / global_count if global_count else 0.0


def stand_in_labels(labels: torch.Tensor) -> torch.Tensor:
    """`labels`, or, when none of them is valid, a copy whose first label is 0: the mean over no labels is NaN (0 /
    0), a mean over the stand-in is finite, and the weight 0 such a micro-batch gets (token_weight of count 0) makes
    its loss and gradients 0. Decided on the labels' device: nothing is read back."""
    flat = labels.flatten().clone()
    none_valid = (flat != IGNORE_INDEX).sum() == 0
    flat[:1] = torch.where(none_valid, torch.zeros_like(flat[:1]), flat[:1])
    return flat.view_as(labels)


def token_weighted_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], share: int,
                        global_count: Callable[[], int]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss_fn(output, labels), a mean over the valid labels, weighted as token_weight weights it, for a caller that
    gets each micro-batch's labels on the device without its index (a pipeline schedule's loss function): the count
    is taken on the device (no read-back); global_count() is the step's (set before the schedule runs)."""

    def weighted(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count = (labels != IGNORE_INDEX).sum()
        loss = loss_fn(output, stand_in_labels(labels))
        # Integers until the division: count x share == global_count gives exactly 1.
        weight = (count * share).float() / max(global_count(), 1)
        return loss * in_loss_form(weight, loss)

    return weighted

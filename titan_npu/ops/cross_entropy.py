"""Mean next-token cross entropy, and the same with the output projection computed a chunk of tokens at a time.

Unchunked, the loss materialises the logits of the whole micro-batch and their fp32 copy, log-softmax and
gradient (8 x 2048 tokens x a 128k vocabulary: 8.4 GB in fp32 alone). The chunked form projects `chunk_tokens`
tokens at a time and takes the cross entropy's gradient with respect to the hidden states and the projection right
there, in the forward, so only one chunk's logits ever exist; backward then only scales the two gradients. Nothing
is recomputed, and the arithmetic is the unchunked path's: the same matmuls (through ops.linear, so every device's
kernel choice holds) on the same inputs, softmax and sums in fp32.

It needs the whole projection weight in the hands of the model's forward: under tensor parallelism the logits are
sharded by vocabulary (and loss_parallel computes the loss on the shards), and a pipeline schedule computes the
loss from the last stage's output outside its forward; those paths take the logits (loss_chunk_tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_npu.ops.dispatch import linear

IGNORE_INDEX = -100  # labels the loss skips (F.cross_entropy's default)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of [B, S, V] logits, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_tokens: int) -> torch.Tensor:
    """cross_entropy_loss(hidden @ weight^T, labels) for hidden [..., D], weight [V, D], holding at most
    chunk_tokens x V logits at a time.

    Under autocast both operands are rounded to its dtype first, as autocast's linear would (the casts are on the
    tape, so fp32 weights get fp32 gradients).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk_tokens)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of h @ w^T over the valid tokens (0 without any), chunk by chunk, with both gradients taken
    in the forward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        want_grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        valid = labels != IGNORE_INDEX
        targets = labels.masked_fill(~valid, 0)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_grads else None
        # fp32 sums across chunks: each chunk's product is rounded once, as the unchunked matmul's would be.
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_grads else None
        for start in range(0, h.shape[0], chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            loss += _chunk(h[chunk], w, targets[chunk], valid[chunk],
                           grad_h[chunk] if want_grads else None, grad_w)
        # No valid label (a fine-tuning micro-batch's shifted labels, say): 0 and zero gradients, not 0 / 0.
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(count, grad_h, grad_w.to(w.dtype) if want_grads else None)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple:
        count, grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss / count
        return grad_h * scale.to(grad_h.dtype), grad_w * scale.to(grad_w.dtype), None, None


def _chunk(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
           grad_h: torch.Tensor | None, grad_w: torch.Tensor | None) -> torch.Tensor:
    """One chunk's summed loss; with grad_h (this chunk's rows) and grad_w given, its gradients written / added
    there. A function of its own, so the chunk's logits are freed before the next chunk's exist.

    One fp32 [C, V] buffer, the logits, serves the log-sum-exp and the gradient: the log-sum-exp is taken in place
    (torch.logsumexp's shifted copy would be a second one). On CPU two such buffers, allocated and freed inside the
    forward, often left enough free memory at the top of glibc's heap for it to go back to the system, to be
    faulted in again by the next step.
    """
    logits = linear(h, w).float()  # [C, V]
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    # torch.logsumexp's shift: the row max, 0 where it is infinite (a row of -inf gives -inf, an inf gives inf).
    shift = logits.amax(dim=-1)
    shift.masked_fill_(shift.abs() == float("inf"), 0.0)
    logits.sub_(shift[:, None]).exp_()  # exp(logit - shift), in place
    sums = logits.sum(dim=-1)
    lse = sums.log() + shift
    loss = ((lse - target_logits) * valid).sum()
    if grad_h is None:
        return loss
    # d(lse - logit_t)/d logits = softmax - one_hot(t), zero for ignored tokens; in place of the logits.
    grad = logits.div_(sums[:, None])
    grad.scatter_add_(1, targets[:, None], torch.full((len(targets), 1), -1.0, device=grad.device))
    grad = grad.mul_(valid[:, None]).to(h.dtype)
    del logits
    grad_h.copy_(linear(grad, w.t()))  # grad @ w
    grad_w += linear(grad.t(), h.t())  # grad^T @ h
    return loss

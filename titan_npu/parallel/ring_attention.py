"""Causal ring attention over the context-parallel ranks, on the load-balanced split of the sequence.

Each of the cp ranks holds two of the sequence's 2 * cp chunks, r and 2 * cp - 1 - r (context_parallel.py), for
its queries, keys and values. The keys/values travel around the ring (rank r sends to r + 1, receives from r - 1)
with batched send/recv while the current block is computed; at ring step i rank r holds those of rank
src = r - i (mod cp), and causality decides what its queries see of them:
  i = 0        its own chunks: causal attention over the local sequence (both chunks are in position order);
  src < r      chunk src precedes both query chunks, chunk 2 * cp - 1 - src follows both: all queries, first half;
  src > r      both key chunks precede query chunk 2 * cp - 1 - r and follow chunk r: second half, all keys.
So every rank computes the same amount. Partial outputs merge by their log-sum-exp (in fp32).

With documents (packed windows, ops/documents.py) each block also gets its part of the document mask: every cp
rank holds the whole window's document ids, so the ids of any rank's chunks are known locally and only the keys and
values travel. A query that sees no key of a block gets lse -inf from it and nothing merges in.

Backward is a custom autograd Function, not autograd through the communication: the keys/values go around the
ring again, each rank computes the blocks' gradients against the merged output and log-sum-exp, dq stays local
and dk/dv travel with the keys/values, arriving back at their owner after the last step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_npu.ops.attention_blocks import block_attention, block_attention_backward
from titan_npu.ops.documents import Documents, document_mask


class _RingExchange:
    """t sent to the next rank of the ring and the previous rank's received, in flight until wait()."""

    def __init__(self, t: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.sent = t  # held until the send has completed
        self.received = torch.empty_like(t)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size),
            dist.P2POp(dist.irecv, self.received, group=group, group_peer=(rank - 1) % size),
        ])

    def wait(self) -> torch.Tensor:
        """The previous rank's tensor, once both transfers are done."""
        for work in self.works:
            work.wait()
        return self.received


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running fp32 (out, lse), in place."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged)[..., None]).add_(block_out.float() * torch.exp(block_lse - merged)[..., None])
    lse.copy_(merged)


def _chunk_ids(ids: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The document ids [B, S / size] of the chunks rank `rank` holds, from the whole window's [B, S]."""
    chunks = ids.chunk(2 * size, dim=1)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=1)


def _block_masks(documents: Documents | None, rank: int, size: int) -> list[torch.Tensor | None]:
    """Per ring step, the document mask of the block this rank computes (None each without documents); built once
    per batch and shared by every layer."""
    if documents is None:
        return [None] * size

    def build() -> list[torch.Tensor]:
        mine = _chunk_ids(documents.ids, rank, size)
        half = mine.shape[1] // 2
        masks = [document_mask(mine, mine, causal=True)]
        for i in range(1, size):
            src = (rank - i) % size
            theirs = _chunk_ids(documents.ids, src, size)
            masks.append(document_mask(mine, theirs[:, :half], False) if src < rank
                         else document_mask(mine[:, half:], theirs, False))
        return masks

    return documents.cached(("ring", rank, size), build)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                  documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged (out fp32 [B, H, S, D], lse [B, H, S]) of the local queries against every rank's keys/values."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    half = q.shape[2] // 2
    masks = _block_masks(documents, rank, size)
    kv = torch.stack((k, v))
    out = lse = None
    for i in range(size):
        exchange = _RingExchange(kv, group, rank, size) if i + 1 < size else None  # the next step's keys/values
        src = (rank - i) % size
        if i == 0:
            # Copies: the merges below work in place, and a kernel's outputs may be cached elsewhere (selective
            # activation checkpointing keeps the attention kernel's outputs and refuses them mutated).
            if masks[0] is None:
                block_out, block_lse = block_attention(q, kv[0], kv[1], causal=True)
            else:  # the document mask holds the causal one
                block_out, block_lse = block_attention(q, kv[0], kv[1], causal=False, mask=masks[0])
            out, lse = block_out.to(torch.float32, copy=True), block_lse.to(torch.float32, copy=True)
        elif src < rank:
            _merge(out, lse, *block_attention(q, kv[0, :, :, :half], kv[1, :, :, :half], causal=False,
                                              mask=masks[i]))
        else:
            _merge(out[:, :, half:], lse[:, :, half:], *block_attention(q[:, :, half:], kv[0], kv[1], causal=False,
                                                                        mask=masks[i]))
        if exchange is not None:
            kv = exchange.wait()
    return out, lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, group: dist.ProcessGroup, documents: Documents | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the local chunks: dq from every block here, dk/dv summed around the ring."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    half = q.shape[2] // 2
    masks = _block_masks(documents, rank, size)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    dkv_exchange = None  # the gradients of the keys/values held next, as the ranks before this one left them
    for i in range(size):
        exchange = _RingExchange(kv, group, rank, size) if i + 1 < size else None
        src = (rank - i) % size
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # grads of the keys/values held now
        if i == 0:
            dq_b, dk_b, dv_b = block_attention_backward(dout, q, kv[0], kv[1], out, lse, causal=masks[0] is None,
                                                        mask=masks[0])
            dq += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
        elif src < rank:
            dq_b, dk_b, dv_b = block_attention_backward(dout, q, kv[0, :, :, :half], kv[1, :, :, :half], out, lse,
                                                        causal=False, mask=masks[i])
            dq += dq_b
            dkv[0, :, :, :half] += dk_b
            dkv[1, :, :, :half] += dv_b
        else:
            dq_b, dk_b, dv_b = block_attention_backward(dout[:, :, half:], q[:, :, half:], kv[0], kv[1],
                                                        out[:, :, half:], lse[:, :, half:], causal=False,
                                                        mask=masks[i])
            dq[:, :, half:] += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
        if dkv_exchange is not None:
            dkv += dkv_exchange.wait()
        dkv_exchange = _RingExchange(dkv, group, rank, size)
        if exchange is not None:
            kv = exchange.wait()
    dkv = dkv_exchange.wait()  # the last hop brings each rank the gradients of its own keys/values
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """ring attention with its own backward: the ring again, not autograd through the sends and receives."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                documents: Documents | None = None) -> torch.Tensor:
        out, lse = _ring_forward(q, k, v, group, documents)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.documents = group, documents
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        return (*_ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.documents), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   documents: Documents | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks, q [B, S_local, Hq, D] and k/v [B, S_local, Hkv, D]
    (Hq a multiple of Hkv), against the whole sequence held by the ranks of `group` -> [B, S_local, Hq, D];
    with documents (of the whole window), within each query's document only."""
    if q.shape[1] % 2:
        raise ValueError(f"ring attention needs the two chunks of the load-balanced split, got {q.shape[1]} positions")
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    return _RingAttention.apply(*heads_first, group, documents).transpose(1, 2)

"""Ulysses attention over the context-parallel ranks: an all-to-all trades the sequence split for a head split.

Each of the cp ranks holds two of the sequence's 2 * cp chunks, r and 2 * cp - 1 - r (the load-balanced split of
context_parallel.py, shared with ring attention), of q/k/v [B, S/cp, H, D]. An all-to-all sends head group g to
rank g and gathers every rank's chunks of this rank's heads: [B, S, H/cp, D], the chunks in rank order. Put back in
position order (chunks 0, 1, ..., 2 * cp - 1), the whole sequence goes through the ordinary causal attention
(ops.attention) on the local heads; the output is put back in rank order and a second all-to-all returns each rank
its chunks with every head. The all-to-alls are autograd-capable: the backward of one is the inverse all-to-all.

Grouped-query attention splits the key/value heads too. With fewer key/value heads than cp ranks (cp a multiple of
n_kv_heads), each is repeated for the cp / n_kv_heads ranks whose query heads read it; autograd sums the copies'
gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titan_npu import ops
from titan_npu.ops.documents import Documents


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[B, S/cp, H, D] of this rank's chunks -> [B, S, H/cp, D] of its head group, every rank's chunks in rank
    order."""
    b, s_local, h, d = x.shape
    send = x.reshape(b, s_local, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp dst, B, S/cp, H/cp, D]
    received = all_to_all_single_autograd(send, None, None, group)  # [cp src, B, S/cp, H/cp, D]
    return received.permute(1, 0, 2, 3, 4).reshape(b, cp * s_local, h // cp, d)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse of _sequence_to_heads: [B, S, H/cp, D] in rank order -> [B, S/cp, H, D] of this rank's chunks."""
    b, s, h_local, d = x.shape
    send = x.reshape(b, cp, s // cp, h_local, d).transpose(0, 1).contiguous()  # [cp dst, B, S/cp, H/cp, D]
    received = all_to_all_single_autograd(send, None, None, group)  # [cp src (head group), B, S/cp, H/cp, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * h_local, d)


def _rank_to_position_order(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, S, ...] with rank r's chunks (r, 2 * cp - 1 - r) at slots 2r, 2r + 1 -> the chunks in position order."""
    pairs = x.unflatten(1, (cp, 2, -1))  # [B, rank, (early, late), chunk, ...]
    return torch.cat((pairs[:, :, 0], pairs[:, :, 1].flip(1)), dim=1).flatten(1, 2)


def _position_to_rank_order(x: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of _rank_to_position_order."""
    chunks = x.unflatten(1, (2 * cp, -1))  # [B, position chunk, chunk, ...]
    return torch.stack((chunks[:, :cp], chunks[:, cp:].flip(1)), dim=2).flatten(1, 3)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                      documents: Documents | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks, q [B, S_local, Hq, D] and k/v [B, S_local, Hkv, D],
    against the whole sequence held by the ranks of `group` -> [B, S_local, Hq, D]. Hq must be a multiple of cp,
    and Hkv a multiple or a divisor of cp. documents (of the whole window): the attention over the whole sequence
    stops at their boundaries."""
    cp, hq, hkv = dist.get_world_size(group), q.shape[2], k.shape[2]
    if hq % cp or (hkv % cp and cp % hkv):
        raise ValueError(f"Ulysses attention over {cp} ranks needs a multiple of {cp} query heads (got {hq}) and "
                         f"key/value heads a multiple or divisor of {cp} (got {hkv}); use parallel.cp_mode = \"ring\"")
    if hkv < cp:
        k, v = k.repeat_interleave(cp // hkv, dim=2), v.repeat_interleave(cp // hkv, dim=2)
    q, k, v = (_rank_to_position_order(_sequence_to_heads(t, group, cp), cp) for t in (q, k, v))
    out = ops.attention(q, k, v, causal=True, documents=documents)
    return _heads_to_sequence(_position_to_rank_order(out, cp), group, cp)

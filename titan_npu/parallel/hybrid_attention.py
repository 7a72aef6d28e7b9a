"""Hybrid context parallelism (USP): Ulysses inside groups of u adjacent cp ranks, ring attention between the groups.

The cp ranks hold the load-balanced chunks of context_parallel.py: rank c has chunks c and 2 * cp - 1 - c of 2 * cp.
Ranks j * u .. j * u + u - 1 form Ulysses group j; together they hold the early chunks j * u .. j * u + u - 1 and the
late chunks 2 * cp - u * (j + 1) .. 2 * cp - 1 - j * u: two contiguous blocks, which are blocks j and 2g - 1 - j of
the sequence cut into 2g blocks of u chunks (g = cp / u groups). After the Ulysses all-to-all within the group, each
rank holds its n_heads / u heads of those two blocks, in position order: exactly the load-balanced split of a ring of
g ranks, so the causal balance holds at both levels. Ring attention then runs over the ring group, the ranks of the
same place i in every Ulysses group (ranks i, u + i, 2u + i, ...; ring rank j), and the inverse all-to-all returns
each rank its chunks with every head. The all-to-alls are autograd-capable and the ring has its own backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_npu.ops.documents import Documents
from titan_npu.parallel.ring_attention import ring_attention
from titan_npu.parallel.ulysses_attention import (
    _heads_to_sequence,
    _position_to_rank_order,
    _rank_to_position_order,
    _sequence_to_heads,
)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group: dist.ProcessGroup,
                     ring_group: dist.ProcessGroup, documents: Documents | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks, q [B, S_local, Hq, D] and k/v [B, S_local, Hkv, D],
    against the whole sequence, Ulysses over `ulysses_group` (u adjacent cp ranks) and the ring over `ring_group`
    (the ranks of the same place in every Ulysses group, in group order) -> [B, S_local, Hq, D]. Hq must be a
    multiple of u, and Hkv a multiple or a divisor of u. documents (of the whole window): within each query's
    document only (the ring's blocks are the load-balanced split of its g ranks, which is how it reads them)."""
    u, hq, hkv = dist.get_world_size(ulysses_group), q.shape[2], k.shape[2]
    if hq % u or (hkv % u and u % hkv):
        raise ValueError(f"hybrid attention with Ulysses groups of {u} ranks needs a multiple of {u} query heads (got "
                         f"{hq}) and key/value heads a multiple or divisor of {u} (got {hkv}); use parallel.cp_mode = "
                         "\"ring\"")
    if hkv < u:
        k, v = k.repeat_interleave(u // hkv, dim=2), v.repeat_interleave(u // hkv, dim=2)
    q, k, v = (_rank_to_position_order(_sequence_to_heads(t, ulysses_group, u), u) for t in (q, k, v))
    out = ring_attention(q, k, v, ring_group, documents)
    return _heads_to_sequence(_position_to_rank_order(out, u), ulysses_group, u)

"""Ring and Ulysses attention over 2 and 4 gloo ranks, and hybrid attention over 4 (Ulysses 2 x ring 2), each rank
holding its load-balanced chunks, equal single-process SDPA on the whole sequence: the output and dq, dk, dv within
fp32 tolerance, with grouped-query heads (for Ulysses at cp 4 and hybrid, fewer key/value heads than ranks, each
repeated) and with equal heads; in bf16 within bf16's rounding of fp32 SDPA on the same inputs; hybrid with packed
documents equals SDPA with the document mask. Ulysses refuses heads that do not split over the ranks."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_npu.ops.documents import Documents, document_mask
from titan_npu.parallel.context_parallel import load_balanced_positions, shard_sequence

from .harness import run_pool

pytestmark = pytest.mark.distributed

TOL = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SEQ = 48  # 2 * cp chunks of 12 (cp = 2) or 6 (cp = 4)


def _inputs(n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, SEQ, n_heads, 16, generator=g)
    k, v = (torch.randn(2, SEQ, n_kv_heads, 16, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, SEQ, n_heads, 16, generator=g)


# Hybrid with packed documents: row 0 holds documents [0, 7), [7, 30), [30, 48); row 1 [0, 13), [13, 48).
DOCUMENT_STARTS = [np.array([7, 30]), np.array([13])]


def _reference(q, k, v, dout, mask=None):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=mask is None,
                                         enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check(mode: str, n_heads: int, n_kv_heads: int, dtype: torch.dtype = torch.float32,
           documented: bool = False) -> None:
    import torch.distributed as dist

    from titan_npu.parallel.hybrid_attention import hybrid_attention
    from titan_npu.parallel.ring_attention import ring_attention
    from titan_npu.parallel.ulysses_attention import ulysses_attention

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    documents = Documents.from_starts(DOCUMENT_STARTS, SEQ, reset_positions=False) if documented else None
    if mode == "hybrid":  # Ulysses within ranks {0, 1} and {2, 3}, the ring between them: {0, 2} and {1, 3}
        groups = _hybrid_groups(ulysses=2)
        attention = partial(hybrid_attention, ulysses_group=groups[0], ring_group=groups[1], documents=documents)
    else:
        attention = partial({"ring": ring_attention, "ulysses": ulysses_attention}[mode], group=dist.group.WORLD)
    q, k, v, dout = (t.to(dtype) for t in _inputs(n_heads, n_kv_heads))
    mask = document_mask(documents.ids, documents.ids, causal=True) if documented else None
    want = [shard_sequence(t, rank, cp) for t in _reference(*(t.float() for t in (q, k, v, dout)), mask)]
    local = [shard_sequence(t, rank, cp).requires_grad_(True) for t in (q, k, v)]
    out = attention(*local)
    out.backward(shard_sequence(dout, rank, cp))
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in local)), want):
        assert got.dtype == dtype, f"{name}: {got.dtype}"
        torch.testing.assert_close(got.float(), expected, **TOL[dtype],
                                   msg=lambda m, n=name: f"{mode} cp={cp} {dtype} rank {rank} {n}: {m}")


def _hybrid_groups(ulysses: int) -> tuple:
    """(Ulysses group, ring group) of this rank: `ulysses` adjacent ranks, and the ranks of the same place in every
    Ulysses group (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [None, None]
    for j in range(world // ulysses):
        group = dist.new_group(list(range(j * ulysses, (j + 1) * ulysses)))
        mine[0] = group if rank // ulysses == j else mine[0]
    for i in range(ulysses):
        group = dist.new_group(list(range(i, world, ulysses)))
        mine[1] = group if rank % ulysses == i else mine[1]
    return tuple(mine)


def _check_ulysses_refuses_heads_that_do_not_split() -> None:
    import torch.distributed as dist

    from titan_npu.parallel.ulysses_attention import ulysses_attention

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cp = dist.get_world_size()
    q, k, v, _ = _inputs(3 * cp, 3 * cp)
    with pytest.raises(ValueError, match=rf"multiple of {cp} query heads \(got {3 * cp + 1}\).*cp_mode = \"ring\""):
        ulysses_attention(torch.cat((q, q[:, :, :1]), dim=2), k, v, dist.group.WORLD)
    with pytest.raises(ValueError, match=rf"multiple or divisor of {cp} \(got 3\)"):
        ulysses_attention(q, k[:, :, :3], v[:, :, :3], dist.group.WORLD)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_ulysses_and_hybrid_attention_match_sdpa_on_the_whole_sequence(cp):
    # Grouped-query (8 query heads over 2 key/value heads) and plain multi-head attention, fp32 and bf16, one pool.
    # Hybrid at cp 4 = Ulysses 2 x ring 2: grouped-query (8 over 2 heads, each group splitting both), a key/value
    # head for both ranks of a Ulysses group (4 over 1: repeated); fp32 and bf16; and with packed documents, against
    # SDPA with the document mask.
    hybrid = [partial(_check, "hybrid", *heads) for heads in [(8, 2), (4, 1), (8, 2, torch.bfloat16),
                                                              (8, 2, torch.float32, True)] if cp == 4]
    run_pool(cp, [partial(_check, mode, *heads) for mode in ("ring", "ulysses") for heads in
                  [(8, 2), (4, 4), (8, 2, torch.bfloat16)]] + [_check_ulysses_refuses_heads_that_do_not_split]
             + hybrid)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_load_balanced_chunks_cover_the_sequence_once_with_equal_causal_work(cp):
    held = [load_balanced_positions(SEQ, r, cp) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(SEQ))
    # Causal work of a query at position p: p + 1 keys. Every rank does the same amount.
    assert len({int((positions + 1).sum()) for positions in held}) == 1
    x = torch.arange(SEQ)[None, :, None]
    assert all(torch.equal(shard_sequence(x, r, cp)[0, :, 0], held[r]) for r in range(cp))


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="2 \\* cp = 4"):
        load_balanced_positions(10, 0, 2)

"""Document masking in attention: the documents of a batch (ops/documents.py) from the loader's document starts,
and every kernel that takes them -- the reference (SDPA with a block-diagonal causal mask), the eager baseline, the
widened bf16 kernel of cpu and the block kernels of the ring -- equal to each document attended on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_npu.ops import cpu, reference
from titan_npu.ops.attention_blocks import (
    cpu_block_attention,
    cpu_block_attention_backward,
    math_block_attention,
    math_block_attention_backward,
)
from titan_npu.ops.documents import Documents, document_mask

SEQ = 16
# Row 0: a document running in from the previous window, two starting inside, one starting at the last label
# (offset SEQ, outside the inputs). Row 1: one starting at offset 0, one inside.
STARTS = [np.array([5, 9, SEQ]), np.array([0, 3])]


def documents(reset_positions: bool = False) -> Documents:
    return Documents.from_starts(STARTS, SEQ, reset_positions)


def qkv(heads: int = 4, kv_heads: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, SEQ, h, 8, generator=g) for h in (heads, kv_heads, kv_heads)]


def separately(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each document of each row through causal SDPA alone, put back in place."""
    out = torch.empty_like(q)
    for row, bounds in enumerate(([0, 5, 9, SEQ], [0, 3, SEQ])):
        for lo, hi in zip(bounds, bounds[1:]):
            out[row, lo:hi] = reference.attention(q[row:row + 1, lo:hi], k[row:row + 1, lo:hi],
                                                  v[row:row + 1, lo:hi])[0]
    return out


def test_documents_from_starts_give_ids_positions_and_cumulative_ends():
    d = documents(reset_positions=True)
    assert d.ids.tolist() == [[0] * 5 + [1] * 4 + [2] * 7, [0] * 3 + [1] * 13]
    assert d.positions.tolist() == [[*range(5), *range(4), *range(7)], [*range(3), *range(13)]]
    assert d.cu_seqlens == [5, 9, 16, 19, 32]  # over the flattened batch: row 1 starts at 16
    assert documents().positions is None


def test_document_mask_is_block_diagonal_and_causal():
    ids = torch.tensor([[0, 0, 1, 1]])
    assert document_mask(ids, ids, causal=True)[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0],
                                                                          [0, 0, 1, 0], [0, 0, 1, 1]]
    assert document_mask(ids, ids, causal=False)[0, 0, 0].int().tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("kernel", ["reference", "eager"])
def test_masked_attention_equals_each_document_on_its_own(kernel):
    fn = reference.attention if kernel == "reference" else reference.eager_attention
    q, k, v = qkv()
    torch.testing.assert_close(fn(q, k, v, documents=documents()), separately(q, k, v), rtol=1e-5, atol=1e-6)


def test_widened_cpu_attention_with_documents_matches_the_reference_and_its_gradients(monkeypatch):
    monkeypatch.setenv(cpu.BF16_MATMUL_ENV, "fp32")
    cpu.widen_bf16.cache_clear()
    try:
        results = {}
        dout = torch.randn(2, SEQ, 4, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
        # The widened kernel computes in fp32 what the reference computes in fp32 on the same bf16 inputs.
        for name, fn, dtype in (("cpu", cpu.attention, torch.bfloat16), ("reference", reference.attention,
                                                                        torch.float32)):
            q, k, v = (t.bfloat16().to(dtype).requires_grad_() for t in qkv())
            out = fn(q, k, v, documents=documents())
            out.backward(dout.to(dtype))
            results[name] = (out.float(), *(t.grad.float() for t in (q, k, v)))
    finally:
        monkeypatch.delenv(cpu.BF16_MATMUL_ENV)
        cpu.widen_bf16.cache_clear()
    for got, want in zip(results["cpu"], results["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # one rounding to bf16


BLOCK_KERNELS = {"cpu_flash": (cpu_block_attention, cpu_block_attention_backward),
                 "math": (math_block_attention, math_block_attention_backward)}


@pytest.mark.parametrize("kernel", list(BLOCK_KERNELS))
def test_block_kernel_with_a_document_mask_matches_masked_sdpa_and_empty_rows_add_nothing(kernel):
    forward, backward = BLOCK_KERNELS[kernel]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, generator=g, requires_grad=True) for _ in range(2))
    q_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [0] * 8])
    k_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8])  # no key of document 2: queries 5-7 of row 0 see none
    mask = document_mask(q_ids, k_ids, causal=False)
    out, lse = forward(q.detach(), k.detach(), v.detach(), False, mask)
    assert torch.equal(out[0, :, 5:], torch.zeros_like(out[0, :, 5:]))
    assert torch.isneginf(lse[0, :, 5:]).all() and torch.isfinite(lse[:, :, :5]).all()
    seen = mask.any(-1, keepdim=True)[:, :, :, :1].expand(2, 4, 8, 16)  # rows that see at least one key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out[seen], want.detach()[seen], rtol=1e-5, atol=2e-6)
    dout = torch.randn(2, 4, 8, 16, generator=g).where(seen, 0.0)
    want.backward(dout)
    # The merged lse of a ring holds the rows' other blocks; here the block is all there is (empty rows: lse 0).
    grads = backward(dout, q.detach(), k.detach(), v.detach(), out, lse.masked_fill(lse.isneginf(), 0.0), False,
                     mask)
    for got, ref in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)

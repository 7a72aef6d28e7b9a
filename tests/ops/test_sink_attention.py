"""Attention with sinks and sliding windows (gpt-oss; ops/reference.py sink_attention): a sink of -inf is plain
causal attention, a sink takes probability mass as one more softmax column, a window hides the keys it leaves
out, documents and windows combine, and ops.attention runs this path whatever the kernels chosen."""

from __future__ import annotations

import numpy as np
import torch

from titan_npu import ops
from titan_npu.ops import reference
from titan_npu.ops.documents import Documents

SEQ, HEADS, KV_HEADS, DIM = 12, 4, 2, 8


def qkv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, SEQ, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]


def test_a_sink_of_minus_infinity_is_plain_causal_attention():
    q, k, v = qkv()
    sinks = torch.full((HEADS,), float("-inf"))
    out = reference.sink_attention(q, k, v, sinks=sinks)
    assert torch.allclose(out, reference.eager_attention(q, k, v), atol=1e-6)


def test_a_sink_is_one_more_softmax_column_whose_value_is_zero():
    q, k, v = qkv(1)
    sinks = torch.randn(HEADS)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * DIM ** -0.5
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    column = sinks.view(1, HEADS, 1, 1).expand(2, HEADS, SEQ, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    want = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(2, dim=2))
    assert torch.allclose(reference.sink_attention(q, k, v, sinks=sinks), want, atol=1e-6)


def test_a_window_hides_the_keys_before_it():
    q, k, v = qkv(2)
    window = 3
    out = reference.sink_attention(q, k, v, sinks=torch.zeros(HEADS), window=window)
    changed = v.clone()
    changed[:, :SEQ - window] += 100.0  # every key the last query's window leaves out
    again = reference.sink_attention(q, k, changed, sinks=torch.zeros(HEADS), window=window)
    assert torch.equal(out[:, -1], again[:, -1])
    assert not torch.allclose(out[:, SEQ - window], again[:, SEQ - window])  # its window reaches back to them


def test_documents_and_the_window_both_apply():
    q, k, v = qkv(3)
    docs = Documents.from_starts([np.array([6]), np.array([])], SEQ, False)
    out = reference.sink_attention(q, k, v, window=4, documents=docs)
    # Row 0's second document (6..11) attended alone with the window is the same.
    alone = reference.sink_attention(q[:1, 6:], k[:1, 6:], v[:1, 6:], window=4)
    assert torch.allclose(out[:1, 6:], alone, atol=1e-6)
    assert torch.allclose(out[1:], reference.sink_attention(q[1:], k[1:], v[1:], window=4), atol=1e-6)


def test_ops_attention_takes_the_sink_path_whatever_the_kernels():
    q, k, v = qkv(4)
    sinks = torch.randn(HEADS)
    want = reference.sink_attention(q, k, v, sinks=sinks, window=5)
    for use_flash in (True, False):
        assert torch.equal(ops.attention(q, k, v, use_flash=use_flash, sinks=sinks, window=5), want)

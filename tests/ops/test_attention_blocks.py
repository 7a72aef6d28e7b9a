"""The block kernel of blockwise attention, on cpu's flash kernel and in plain math: the output, its log-sum-exp
and the backward (given the block's own output and log-sum-exp) equal SDPA and autograd through it, within fp32
tolerance; causal and not, grouped-query heads, more keys than queries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_npu.ops.attention_blocks import (
    cpu_block_attention,
    cpu_block_attention_backward,
    math_block_attention,
    math_block_attention_backward,
)

TOL = dict(rtol=1e-5, atol=2e-6)
KERNELS = {"cpu_flash": (cpu_block_attention, cpu_block_attention_backward),
           "math": (math_block_attention, math_block_attention_backward)}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(("heads", "kv_heads", "sq", "sk", "causal"),
                         [(4, 4, 16, 16, True), (8, 2, 16, 16, True), (8, 2, 8, 24, False), (4, 1, 24, 8, False)])
def test_block_kernel_matches_sdpa_and_its_gradients(kernel, heads, kv_heads, sq, sk, causal):
    forward, backward = KERNELS[kernel]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, sq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, sk, 16, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, heads, sq, 16, generator=g)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    want.backward(dout)
    scores = q.detach() @ k.detach().repeat_interleave(heads // kv_heads, 1).transpose(-2, -1) / 4.0
    if causal:
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))

    out, lse = forward(q.detach(), k.detach(), v.detach(), causal)
    torch.testing.assert_close(out, want.detach(), **TOL)
    torch.testing.assert_close(lse, scores.logsumexp(-1), **TOL)
    grads = backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, (q.grad, k.grad, v.grad)):
        assert got.shape == expected.shape, name
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")

"""The block kernel of blockwise attention, on cpu's flash kernel and in plain math: the output, its log-sum-exp
and the backward (given the block's own output and log-sum-exp) equal SDPA and autograd through it, within fp32
tolerance; causal and not, grouped-query heads, more keys than queries. The kernel follows the device type; on CUDA
(where a GPU is present) the FlashAttention / memory-efficient kernels equal the math kernel, and which of the two
runs is decided by rules checked here on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_npu.ops import attention_blocks as blocks
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


def test_the_block_kernel_is_chosen_by_the_device_type():
    assert blocks.block_kernels("cpu") == (blocks.cpu_block_attention, blocks.cpu_block_attention_backward)
    assert blocks.block_kernels("npu") == (blocks.npu_block_attention, blocks.npu_block_attention_backward)
    assert blocks.block_kernels("cuda") == (blocks.cuda_block_attention, blocks.cuda_block_attention_backward)
    for other in ("xpu", "mps", "meta"):
        assert blocks.block_kernels(other) == (blocks.math_block_attention, blocks.math_block_attention_backward)


@pytest.mark.parametrize(("dtype", "head_dim", "masked"), [(torch.float32, 64, False), (torch.bfloat16, 12, False),
                                                           (torch.bfloat16, 264, False), (torch.bfloat16, 64, True)],
                         ids=["fp32", "head_dim_12", "head_dim_264", "document_mask"])
def test_cuda_blocks_leave_flash_attention_for_inputs_it_cannot_take(dtype, head_dim, masked):
    # Decided before the GPU's capability is asked: the memory-efficient kernel takes these.
    q = torch.zeros(1, 2, 4, head_dim, dtype=dtype)
    assert not blocks.cuda_uses_flash(q, torch.ones(1, 1, 4, 4, dtype=torch.bool) if masked else None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "causal", "masked"), [(torch.bfloat16, True, False), (torch.float32, True, False),
                                                         (torch.float32, False, True), (torch.bfloat16, False, True)])
def test_cuda_block_kernel_matches_the_math_kernel(dtype, causal, masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, 64, generator=g).to("cuda", dtype)
    k, v = (torch.randn(2, 2, 64, 64, generator=g).to("cuda", dtype) for _ in range(2))
    dout = torch.randn(2, 8, 64, 64, generator=g).to("cuda", dtype)
    ids = torch.arange(64, device="cuda").div(20, rounding_mode="floor")[None].expand(2, -1)
    mask = (ids[:, :, None] == ids.flip(1)[:, None, :])[:, None] if masked else None  # some rows see no key
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    out, lse = blocks.cuda_block_attention(q, k, v, causal, mask)
    want_out, want_lse = blocks.math_block_attention(q, k, v, causal, mask)
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    finite = want_lse.masked_fill(want_lse.isneginf(), 0.0)
    grads = blocks.cuda_block_attention_backward(dout, q, k, v, want_out, finite, causal, mask)
    for got, want in zip(grads, blocks.math_block_attention_backward(dout, q, k, v, want_out, finite, causal, mask),
                         strict=True):
        torch.testing.assert_close(got.float(), want.float(), **tol)

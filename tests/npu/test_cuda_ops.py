"""The CUDA backend: SDPA limited to the flash and memory-efficient kernels, held to the reference.

The wrapper's own logic (layout, GQA, causal flag) is checked on the CPU, whose SDPA has a flash kernel too; the
GPU kernels themselves are checked where a GPU is present (and by examples/gpu_smoke.sh).
"""

from __future__ import annotations

import pytest
import torch
from op_compare import assert_same_forward_and_backward, qkv

from titan_npu.ops import cuda as cuda_ops
from titan_npu.ops import current_kernels, reference

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_only_attention_has_a_cuda_kernel():
    assert current_kernels("cuda") == {"attention": "cuda", "rms_norm": "reference", "apply_rotary_emb": "reference",
                                       "swiglu": "reference", "linear": "reference", "swiglu_linear": "reference"}


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_sdpa_wrapper_matches_the_reference_on_cpu_tensors(heads, kv_heads, causal):
    fused = lambda q, k, v: cuda_ops.attention(q, k, v, causal=causal)  # noqa: E731
    ref = lambda q, k, v: reference.attention(q, k, v, causal=causal)  # noqa: E731
    assert_same_forward_and_backward(fused, ref, list(qkv(2, 45, heads, kv_heads)))


def test_flash_is_only_claimed_for_half_precision_on_a_gpu():
    assert not cuda_ops.flash_supported(torch.randn(1, 4, 2, 64))
    assert not cuda_ops.flash_supported(torch.randn(1, 4, 2, 64, dtype=torch.bfloat16))  # a CPU tensor


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("seq", [37, 2100])
def test_gpu_fused_attention_matches_the_eager_reference(dtype, tol, heads, kv_heads, seq):
    q, k, v = (x.cuda() for x in qkv(2, seq, heads, kv_heads, head_dim=64))
    got = cuda_ops.attention(q.to(dtype), k.to(dtype), v.to(dtype))
    want = reference.eager_attention(q, k, v)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)

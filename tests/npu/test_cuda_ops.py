"""The CUDA backend: SDPA on the fused kernels in an order chosen by the GPU's capability, held to the reference.

The wrapper's own logic (layout, GQA, causal flag) is checked on the CPU, whose SDPA has a flash kernel too; the
GPU kernels themselves are checked where a GPU is present (and by examples/gpu_smoke.sh).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_compare import assert_same_forward_and_backward, qkv
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

from titan_npu.config.loader import load_config
from titan_npu.config.options import ATTENTION_BACKENDS
from titan_npu.errors import ConfigError
from titan_npu.ops import OP_NAMES, current_kernels, reference
from titan_npu.ops import cuda as cuda_ops

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_only_attention_and_the_grouped_gemm_have_cuda_kernels():
    assert current_kernels("cuda") == {op: "cuda" if op in ("attention", "grouped_mm") else "reference"
                                       for op in OP_NAMES}


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


@pytest.fixture
def attention_order():
    """The kernel order is a per-run global: each test's choice is undone after it."""
    before = list(cuda_ops._priority)
    yield
    cuda_ops._priority[:] = before


@pytest.mark.parametrize("capability,order", [
    ((9, 0), ["cudnn", "flash", "efficient"]), ((10, 0), ["cudnn", "flash", "efficient"]),
    ((8, 0), ["flash", "cudnn", "efficient"]), ((8, 9), ["flash", "cudnn", "efficient"]),
    ((7, 5), ["efficient"]), (None, ["efficient"]),
])
def test_the_kernel_order_follows_the_gpu_capability(capability, order):
    assert cuda_ops.attention_priority(capability) == order


def test_a_forced_kernel_is_the_only_one_and_an_unknown_name_is_refused():
    assert cuda_ops.attention_priority((9, 0), "flash") == ["flash"]
    with pytest.raises(ConfigError, match="attention_backend = 'math' is not one of auto, cudnn, flash, efficient"):
        cuda_ops.attention_priority((9, 0), "math")


def test_the_config_accepts_the_kernels_the_cuda_backend_knows():
    assert set(ATTENTION_BACKENDS) == set(cuda_ops.ATTENTION_BACKENDS)
    assert load_config(None, ["--model.attention_backend", "cuDNN"]).model.attention_backend == "cudnn"
    with pytest.raises(ConfigError, match="model.attention_backend"):
        load_config(None, ["--model.attention_backend", "math"])


@pytest.mark.usefixtures("attention_order")
def test_sdpa_runs_with_the_configured_order_as_its_priority(monkeypatch):
    """Checked on CPU with a mocked Hopper capability: the order SDPA sees inside the wrapper is the one chosen."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(_cur_sdpa_kernel_backends(with_priority=True))
        return sdpa(*args, **kwargs)

    cuda_ops.configure_attention((9, 0))
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cuda_ops.attention(*qkv(1, 8, 2, 2))
    assert seen == [[SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]]


@pytest.mark.usefixtures("attention_order")
@pytest.mark.parametrize("usable,expected", [
    ({"cudnn", "flash", "efficient"}, "cudnn (order cudnn > flash > efficient)"),
    ({"flash", "efficient"}, "flash (order cudnn > flash > efficient)"),
    ({"efficient"}, "efficient (order cudnn > flash > efficient)"),
])
def test_the_log_names_the_first_kernel_whose_checks_pass(monkeypatch, usable, expected):
    """SDPA's own checks (torch.backends.cuda.can_use_*) are mocked, and so is an sm90 GPU: the CPU has neither."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name in cuda_ops.CAN_USE:
        monkeypatch.setitem(cuda_ops.CAN_USE, name, lambda params, name=name: name in usable)
    got = cuda_ops.choose_attention_kernel(torch.device("cpu"), "auto", torch.bfloat16, 4, 2, 16, 32)
    assert got == expected


@pytest.mark.usefixtures("attention_order")
def test_a_forced_kernel_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setitem(cuda_ops.CAN_USE, "cudnn", lambda params: False)
    with pytest.raises(ConfigError, match=r"no fused attention kernel \(cudnn\) takes torch.float32 heads of size 16"):
        cuda_ops.choose_attention_kernel(torch.device("cpu"), "cudnn", torch.float32, 4, 4, 16, 32)


# --- grouped GEMM: torch._grouped_mm on bf16 sm90+ --------------------------------------------------------------

def _experts(k: int, m: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(10, k, dtype=dtype), torch.empty(4, m, k, dtype=dtype)


@pytest.mark.parametrize("capability,dtype,k,m,eligible", [
    ((9, 0), torch.bfloat16, 64, 96, True),
    ((10, 0), torch.bfloat16, 64, 96, True),
    ((8, 9), torch.bfloat16, 64, 96, False),  # Ada: torch's slow per-group fallback; the reference instead
    (None, torch.bfloat16, 64, 96, False),  # not a GPU
    ((9, 0), torch.float32, 64, 96, False),  # the fast kernel is bf16 only
    ((9, 0), torch.bfloat16, 60, 96, False),  # K = 120 bytes: not a multiple of 16
    ((9, 0), torch.bfloat16, 64, 100, False),  # M = 200 bytes: the output's and the gradient's rows
], ids=["sm90", "sm100", "sm89", "cpu", "fp32", "k-unaligned", "m-unaligned"])
def test_the_grouped_gemm_takes_torch_grouped_mm_only_where_its_fast_kernel_runs(capability, dtype, k, m, eligible):
    x, w = _experts(k, m, dtype)
    assert cuda_ops.grouped_mm_eligible(x, w, capability) is eligible


def test_the_cuda_grouped_gemm_on_cpu_tensors_is_the_reference():
    x, w = torch.randn(9, 16), torch.randn(3, 8, 16)
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32)
    assert_same_forward_and_backward(lambda x, w: cuda_ops.grouped_mm(x, w, offsets),
                                     lambda x, w: reference.padded_grouped_mm(x, w, offsets), [x, w])


@needs_gpu
def test_gpu_grouped_gemm_matches_the_per_group_reference_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    sizes = [37, 0, 120, 5]
    x, w = torch.randn(sum(sizes), 64, generator=g).cuda(), (torch.randn(4, 96, 64, generator=g) / 8).cuda()
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    results = []
    for fn, dtype in ((cuda_ops.grouped_mm, torch.bfloat16), (reference.padded_grouped_mm, torch.float32)):
        xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        out = fn(xs, ws, offsets)
        out.float().square().sum().backward()
        results.append((out.float(), xs.grad.float(), ws.grad.float()))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)

"""CPU kernels: bf16 matmuls and attention widened to fp32 keep bf16 numerics (held to torch's bf16 kernels)."""

import pytest
import torch
import torch.nn.functional as F

from titan_npu import ops
from titan_npu.device import DeviceInfo, flops
from titan_npu.errors import ConfigError
from titan_npu.ops import cpu, reference

BF16_ULP = 2.0**-8  # relative spacing of bf16 values: one rounding step


@pytest.fixture
def widen(monkeypatch):
    """Force the widened kernels whatever this machine's instructions, and restore the choice afterwards."""
    monkeypatch.setenv(cpu.BF16_MATMUL_ENV, "fp32")
    cpu.widen_bf16.cache_clear()
    ops.set_kernels("auto")
    yield
    monkeypatch.delenv(cpu.BF16_MATMUL_ENV)
    cpu.widen_bf16.cache_clear()
    ops.set_kernels("auto")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _linear_fwd_bwd(kernels: str, x: torch.Tensor, w: torch.Tensor, autocast: bool):
    ops.set_kernels(kernels)
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = ops.linear(x, w)
    (y.float().sin()).sum().backward()
    return y, x.grad, w.grad


def test_widened_linear_under_autocast_matches_torch_bf16_linear(widen):
    torch.manual_seed(0)
    x, w = torch.randn(2, 48, 96), torch.randn(80, 96)
    ours = _linear_fwd_bwd("auto", x, w, autocast=True)
    torch_bf16 = _linear_fwd_bwd("reference", x, w, autocast=True)
    for a, b in zip(ours, torch_bf16):
        assert a.dtype == b.dtype and a.shape == b.shape  # bf16 output, fp32 gradients for fp32 leaves
        assert _rel(a, b) <= 2 * BF16_ULP  # both round fp32 sums to bf16; only the order of the sums differs


def test_widened_linear_on_bf16_tensors_rounds_the_exact_product_once(widen):
    torch.manual_seed(1)
    x, w = torch.randn(64, 128).bfloat16(), torch.randn(32, 128).bfloat16()
    y, gx, gw = _linear_fwd_bwd("auto", x, w, autocast=False)
    exact = x.double() @ w.double().t()
    assert y.dtype == gx.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact, rtol=BF16_ULP, atol=1e-6)
    g = y.float().cos().bfloat16().double()  # d sin(y) / dy as the backward saw it: rounded to y's dtype
    torch.testing.assert_close(gx.double(), g @ w.double(), rtol=BF16_ULP, atol=1e-5)
    torch.testing.assert_close(gw.double(), g.t() @ x.double(), rtol=BF16_ULP, atol=1e-5)


def test_fp32_linear_is_torch_linear_bit_for_bit(widen):
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))


def test_widened_attention_matches_torch_bf16_sdpa_with_grouped_heads(widen):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 40, 8, 16), torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)

    def run(kernels):
        ops.set_kernels(kernels)
        ins = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        out = ops.attention(*ins, causal=True)
        out.float().square().sum().backward()
        return [out] + [t.grad for t in ins]

    for a, b in zip(run("auto"), run("reference")):
        assert a.dtype == b.dtype == torch.bfloat16
        assert _rel(a, b) <= 4 * BF16_ULP


def test_a_tiny_bf16_model_trains_the_same_with_widened_kernels(widen):
    from titan_npu.models.llama import LlamaArgs, Transformer

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, max_seq_len=32)
    torch.manual_seed(3)
    model = Transformer(args)
    tokens = torch.randint(0, 128, (2, 33))

    def loss_and_grad(kernels):
        ops.set_kernels(kernels)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    (loss_w, grad_w), (loss_t, grad_t) = loss_and_grad("auto"), loss_and_grad("reference")
    assert ops.current_kernels("cpu")["linear"] == "reference"
    assert abs(loss_w - loss_t) <= 1e-2 * abs(loss_t)
    assert torch.nn.functional.cosine_similarity(grad_w, grad_t, dim=0) > 0.999


def test_native_choice_keeps_torch_bf16_kernels(monkeypatch):
    monkeypatch.setenv(cpu.BF16_MATMUL_ENV, "native")
    cpu.widen_bf16.cache_clear()
    try:
        assert cpu.widen_bf16() is False
        x, w = torch.randn(8, 16).bfloat16(), torch.randn(4, 16).bfloat16()
        assert torch.equal(cpu.linear(x, w), F.linear(x, w))
    finally:
        monkeypatch.delenv(cpu.BF16_MATMUL_ENV)
        cpu.widen_bf16.cache_clear()


def test_an_unknown_bf16_matmul_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu.BF16_MATMUL_ENV, "fast")
    cpu.widen_bf16.cache_clear()
    try:
        with pytest.raises(ConfigError, match="TITAN_CPU_BF16_MATMUL='fast'.*auto, fp32, native"):
            cpu.widen_bf16()
    finally:
        monkeypatch.delenv(cpu.BF16_MATMUL_ENV)
        cpu.widen_bf16.cache_clear()


def test_widened_bf16_mfu_is_against_the_fp32_peak(widen, monkeypatch):
    monkeypatch.setattr(flops, "cpu_peak_flops", lambda dtype: {torch.float32: 300e9, torch.bfloat16: 60e9}[dtype])
    assert flops.peak_flops(DeviceInfo("cpu", 0, "gloo"), torch.bfloat16) == 300e9
    monkeypatch.setenv(cpu.BF16_MATMUL_ENV, "native")
    cpu.widen_bf16.cache_clear()
    assert flops.peak_flops(DeviceInfo("cpu", 0, "gloo"), torch.bfloat16) == 60e9


def test_reference_linear_is_torch_linear():
    x, w = torch.randn(3, 5), torch.randn(2, 5)
    assert torch.equal(reference.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_widened_kernels_are_well_formed_custom_ops_for_torch_compile(layout):
    """Fake kernels, autograd registration and schemas agree with the real kernels (what compiled graphs rely on)."""
    q = torch.randn(2, 16, 4, 8).bfloat16()
    q = q.transpose(1, 2) if layout == "bshd" else q.permute(0, 2, 1, 3).contiguous()
    qkv = [q.clone().requires_grad_() for _ in range(3)]
    torch.library.opcheck(cpu._widened_attention, (*qkv, True))
    x, w = torch.randn(3, 4, 8).bfloat16().requires_grad_(), torch.randn(5, 8).bfloat16().requires_grad_()
    torch.library.opcheck(cpu._widened_linear, (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_router_softmax_gives_the_reference_probabilities_choices_and_gradients(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(257, 8, generator=g)).to(dtype)
    cotangent = torch.randn(257, 8, generator=g)
    results = []
    for kernel in (cpu.moe_topk_softmax, reference.moe_topk_softmax):
        x = logits.clone().requires_grad_()
        probs, experts = kernel(x, 2)
        (probs * cotangent).sum().backward()
        results.append((probs, experts, x.grad))
    (probs, experts, grad), (want_probs, want_experts, want_grad) = results
    assert probs.dtype == torch.float32 and probs.shape == (257, 8)
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-7)  # fp32 sums in another order: an ulp
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)

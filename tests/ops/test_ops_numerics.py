"""Each op (through the dispatcher, reference kernels) against an independent naive implementation, fwd and bwd."""

import math

import pytest
import torch

from titan_npu import ops

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _assert_same_forward_and_grads(fn, naive, inputs, tol=TOL):
    """fn and naive (float64) agree on the output and on the gradients of a random projection of it."""
    ours_in = _leaves(*inputs)
    ref_in = _leaves(*(t.double() for t in inputs))
    out, ref = fn(*ours_in), naive(*ref_in)
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o.double(), r, **tol)
    cotangents = [torch.randn_like(r) for r in refs]
    sum((o.double() * c).sum() for o, c in zip(outs, cotangents)).backward()
    sum((r * c).sum() for r, c in zip(refs, cotangents)).backward()
    for a, b in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol)


def _naive_attention(q, k, v, causal):
    """Loop over batch and query heads; query head h reads key/value head h // (Hq / Hkv)."""
    bsz, seqlen, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(bsz):
        for h in range(n_heads):
            qh, kh, vh = q[b, :, h], k[b, :, h // group], v[b, :, h // group]
            scores = qh @ kh.T / math.sqrt(head_dim)
            if causal:
                future = torch.arange(seqlen)[None, :] > torch.arange(seqlen)[:, None]
                scores = scores.masked_fill(future, float("-inf"))
            out[b, :, h] = torch.softmax(scores, dim=-1) @ vh
    return out


@pytest.mark.parametrize("use_flash", [True, False], ids=["flash", "eager"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_attention_matches_naive_loop_forward_and_backward(use_flash, causal, heads):
    torch.manual_seed(0)
    n_heads, n_kv_heads = heads
    q, k, v = torch.randn(2, 7, n_heads, 8), torch.randn(2, 7, n_kv_heads, 8), torch.randn(2, 7, n_kv_heads, 8)
    _assert_same_forward_and_grads(
        lambda q, k, v: ops.attention(q, k, v, causal=causal, use_flash=use_flash),
        lambda q, k, v: _naive_attention(q, k, v, causal),
        (q, k, v),
    )


def test_attention_flash_and_eager_agree_on_gqa():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 33, 8, 16), torch.randn(3, 33, 2, 16), torch.randn(3, 33, 2, 16)
    flash = ops.attention(q, k, v, use_flash=True)
    eager = ops.attention(q, k, v, use_flash=False)
    torch.testing.assert_close(flash, eager, **TOL)


def test_attention_is_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    k2, v2 = k.clone(), v.clone()
    k2[:, 6:], v2[:, 6:] = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    for use_flash in (True, False):
        a = ops.attention(q, k, v, use_flash=use_flash)
        b = ops.attention(q, k2, v2, use_flash=use_flash)
        torch.testing.assert_close(a[:, :6], b[:, :6], atol=0, rtol=0)
        assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_eager_attention_softmax_in_fp32_keeps_bf16_close_to_fp32():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    ref = ops.attention(q, k, v, use_flash=False)
    low = ops.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), use_flash=False)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


def _naive_rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def test_rms_norm_matches_naive_forward_and_backward():
    torch.manual_seed(4)
    x, w = torch.randn(2, 5, 32) * 3, torch.randn(32)
    _assert_same_forward_and_grads(lambda x, w: ops.rms_norm(x, w, 1e-5), lambda x, w: _naive_rms_norm(x, w, 1e-5),
                                   (x, w))


def test_rms_norm_returns_the_input_dtype_computed_in_fp32():
    torch.manual_seed(5)
    x, w = torch.randn(4, 64, dtype=torch.bfloat16) * 100, torch.ones(64)
    out = ops.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    # bf16 has 8 mantissa bits: one rounding of an fp32 result is within 2^-8 relative.
    torch.testing.assert_close(out.float(), _naive_rms_norm(x.double(), w.double(), 1e-6).float(), atol=0, rtol=2**-8)


def _naive_rope(xq, xk, cos, sin):
    """Meta's original formulation: pairs (2i, 2i+1) as complex numbers times exp(i * angle)."""
    rotation = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[None, :, None, :]

    def rotate(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rotation).flatten(-2)

    return rotate(xq), rotate(xk)


def test_rotary_embedding_matches_complex_rotation_forward_and_backward():
    torch.manual_seed(6)
    seqlen, head_dim = 9, 16
    angles = torch.arange(seqlen)[:, None] * (10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim))[None, :]
    cos, sin = angles.cos(), angles.sin()
    xq, xk = torch.randn(2, seqlen, 4, head_dim), torch.randn(2, seqlen, 2, head_dim)
    ours_in, ref_in = _leaves(xq, xk), _leaves(xq.double(), xk.double())
    out = ops.apply_rotary_emb(*ours_in, cos, sin)
    ref = _naive_rope(*ref_in, cos.double(), sin.double())
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o.double(), r, **TOL)
    cot = [torch.randn_like(r) for r in ref]
    sum((o.double() * c).sum() for o, c in zip(out, cot)).backward()
    sum((r * c).sum() for r, c in zip(ref, cot)).backward()
    for a, b in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **TOL)


def test_rotary_embedding_preserves_norm_of_each_pair_and_dtype():
    torch.manual_seed(7)
    angles = torch.rand(5, 4) * 6
    cos, sin = angles.cos(), angles.sin()
    xq = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16)
    rq, rk = ops.apply_rotary_emb(xq, xq, cos, sin)
    assert rq.dtype == rk.dtype == torch.bfloat16
    pair_norm = lambda t: t.float().unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(rq), pair_norm(xq), atol=2e-2, rtol=2e-2)


def test_swiglu_matches_naive_forward_and_backward():
    torch.manual_seed(8)
    gate, up = torch.randn(3, 4, 24) * 4, torch.randn(3, 4, 24)
    _assert_same_forward_and_grads(ops.swiglu, lambda g, u: g / (1 + torch.exp(-g)) * u, (gate, up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_compiled_real_rotary_form_equals_the_eager_complex_form_within_fp32_rounding(dtype):
    torch.manual_seed(9)
    angles = torch.arange(33)[:, None] * (500000.0 ** (-torch.arange(0, 64, 2) / 64))[None, :]
    cos, sin = angles.cos(), angles.sin()
    x = torch.randn(2, 33, 4, 64).to(dtype)
    real, cplx = ops.reference.rotate_pairs_real(x, cos, sin), ops.reference.rotate_pairs_complex(x, cos, sin)
    # fp32: each output is a*c -/+ b*s, two products and a sum either way: within a few ulps of 1 (|x| ~ 4).
    # bf16: the same fp32 value rounded once, so at most one bf16 ulp apart where rounding ties differ.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2**-8 * 4, rtol=2**-8)
    torch.testing.assert_close(real, cplx, **tol)
    # The backward of either is the other rotation by -angle.
    torch.testing.assert_close(ops.reference.rotate_pairs_real(real, cos, -sin),
                               ops.reference.rotate_pairs_complex(cplx, cos, -sin), **tol)


def test_compiled_rotary_embedding_is_generated_code_without_graph_breaks_or_eager_fallbacks():
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    torch.manual_seed(10)
    angles = torch.rand(16, 4) * 6
    xq, xk = _leaves(torch.randn(2, 16, 4, 8), torch.randn(2, 16, 2, 8))
    explained = torch._dynamo.explain(ops.reference.apply_rotary_emb)(xq, xk, angles.cos(), angles.sin())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    metrics.reset()
    counters.clear()
    rq, rk = torch.compile(ops.reference.apply_rotary_emb, backend="inductor")(xq, xk, angles.cos(), angles.sin())
    (rq.sum() + rk.sum()).backward()
    eager_q, eager_k = ops.reference.apply_rotary_emb(xq.detach(), xk.detach(), angles.cos(), angles.sin())
    torch.testing.assert_close(rq, eager_q, atol=1e-6, rtol=1e-6)  # compiled (real) vs eager (complex)
    torch.testing.assert_close(rk, eager_k, atol=1e-6, rtol=1e-6)
    # Eager kernels called from the compiled graph count as extern calls (a complex product is one per op).
    assert counters["inductor"]["extern_calls"] == 0
    # One fused kernel per rotated tensor, forward and backward.
    assert 0 < metrics.generated_kernel_count <= 4
    torch._dynamo.reset()


def _naive_order(experts):
    """The token copies t * k + j listed by expert, then by copy index (a stable sort, as a Python loop)."""
    flat = experts.reshape(-1).tolist()
    return torch.tensor(sorted(range(len(flat)), key=lambda i: (flat[i], i)))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_permute_and_unpermute_match_naive_loops_forward_and_backward(top_k):
    torch.manual_seed(9)
    tokens, n_experts = 12, 5
    experts = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(tokens)])
    order = _naive_order(experts)
    _assert_same_forward_and_grads(lambda x: ops.moe_permute(x, experts)[0],
                                   lambda x: torch.stack([x[i // top_k] for i in order.tolist()]),
                                   (torch.randn(tokens, 6),))
    position = {copy: i for i, copy in enumerate(order.tolist())}

    def naive_unpermute(routed, weights):
        return torch.stack([sum(weights[t, j] * routed[position[t * top_k + j]] for j in range(top_k))
                            for t in range(tokens)])

    _assert_same_forward_and_grads(lambda routed, weights: ops.moe_unpermute(routed, order, weights),
                                   naive_unpermute, (torch.randn(tokens * top_k, 6), torch.rand(tokens, top_k)))
    assert torch.equal(ops.moe_permute(torch.randn(tokens, 6), experts)[1], order)


def test_moe_unpermute_at_top_2_is_the_weighted_sum_over_each_tokens_copies_bit_for_bit():
    torch.manual_seed(10)
    tokens, top_k = 64, 2
    experts = torch.stack([torch.randperm(8)[:top_k] for _ in range(tokens)])
    routed, order = ops.moe_permute(torch.randn(tokens, 16), experts)
    weights = torch.rand(tokens, top_k)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0]))
    want = (routed[inverse].view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
    assert torch.equal(ops.moe_unpermute(routed, order, weights), want)

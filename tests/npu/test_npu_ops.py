"""The NPU kernels (ops/npu.py, through the fake torch_npu) give the plain-torch reference's numbers, forward and
backward; a wrapper that passes a wrong layout, mask, mode, scale or operand order fails the same checks."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from op_compare import assert_same_forward_and_backward, qkv

from titan_npu.ops import attention_blocks as blocks
from titan_npu.ops import npu as npu_ops
from titan_npu.ops import reference
from titan_npu.ops.documents import Documents


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    return angles.cos(), angles.sin()


# --- attention ---------------------------------------------------------------------------------------------------

# Sequence lengths: a single token, lengths that are not multiples of 128, and one past the 2048 compressed mask.
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("seq", [1, 37, 128, 300])
def test_fused_attention_matches_reference(fake_torch_npu, heads, kv_heads, seq):
    assert_same_forward_and_backward(npu_ops.attention, reference.attention, list(qkv(2, seq, heads, kv_heads)))


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (2, 1)], ids=["mha", "gqa"])
def test_fused_attention_matches_reference_beyond_the_2048_mask(fake_torch_npu, heads, kv_heads):
    # 2100 > 2048 and not a multiple of 128: the kernel must extend the compressed mask past its own size.
    assert_same_forward_and_backward(
        npu_ops.attention, reference.attention, list(qkv(2, 2100, heads, kv_heads, head_dim=8))
    )


def test_fused_attention_non_causal_matches_reference(fake_torch_npu):
    q, k, v = qkv(2, 45, 4, 2)
    assert_same_forward_and_backward(
        functools.partial(npu_ops.attention, causal=False), functools.partial(reference.attention, causal=False),
        [q, k, v],
    )


def test_fused_attention_aligns_causality_top_left_like_sdpa_when_lengths_differ(fake_torch_npu):
    q, k, v = qkv(2, 5, 4, 4, kv_seq=9)
    assert_same_forward_and_backward(npu_ops.attention, reference.attention, [q, k, v])


def test_fused_attention_calls_the_kernel_once_with_bsnd_and_the_compressed_causal_mask(fake_torch_npu):
    fake_torch_npu.calls.clear()
    npu_ops.attention(*qkv(1, 8, 4, 2))
    assert fake_torch_npu.calls["npu_fusion_attention"] == 1
    mask = npu_ops.causal_mask(torch.device("cpu"))
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    assert torch.equal(mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))


def test_fused_attention_bf16_is_close_to_the_fp32_reference(fake_torch_npu):
    q, k, v = qkv(2, 70, 4, 2)
    expected = reference.attention(q, k, v)
    got = npu_ops.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def _kernel(torch_npu, q, k, v, *, layout="BSND", mask="triu", sparse_mode=2, scale=None):
    """npu_fusion_attention called the way a (possibly broken) wrapper might."""
    masks = {"triu": torch.ones(2048, 2048, dtype=torch.bool).triu(1),
             "tril": torch.ones(2048, 2048, dtype=torch.bool).tril(-1),
             "keep_true": ~torch.ones(2048, 2048, dtype=torch.bool).triu(1)}
    kwargs = {"scale": q.shape[-1] ** -0.5 if scale is None else scale, "keep_prob": 1.0, "sparse_mode": sparse_mode}
    if mask is not None:
        kwargs["atten_mask"] = masks[mask]
    return torch_npu.npu_fusion_attention(q, k, v, q.shape[2], layout, **kwargs)[0]


@pytest.mark.parametrize(
    "broken",
    [
        dict(layout="BNSD"),  # our [B, S, H, D] is not BNSD
        dict(mask="tril"),  # the lower triangle masked: future visible, past hidden
        dict(mask="keep_true"),  # True meaning "keep" (SDPA's convention) instead of "masked out"
        dict(mask=None, sparse_mode=0),  # no causal mask at all
        dict(sparse_mode=3),  # bottom-right causal: differs when query and key lengths differ
        dict(scale=1.0 / 16),  # 1/D instead of 1/sqrt(D)
    ],
    ids=["layout", "tril-mask", "inverted-mask", "no-mask", "sparse-mode-3", "scale"],
)
def test_a_wrong_layout_mask_mode_or_scale_fails_the_reference_check(fake_torch_npu, broken):
    q, k, v = qkv(2, 6, 4, 4, kv_seq=10)
    with pytest.raises((AssertionError, RuntimeError)):
        assert_same_forward_and_backward(
            functools.partial(_kernel, fake_torch_npu, **broken), reference.attention, [q, k, v]
        )


def test_bnsd_layout_on_bsnd_tensors_gives_wrong_numbers_even_when_the_shapes_fit(fake_torch_npu):
    q, k, v = qkv(2, 4, 4, 4)  # S == H: the kernel cannot see the mistake from the shapes
    with pytest.raises(AssertionError, match="forward differs"):
        assert_same_forward_and_backward(
            functools.partial(_kernel, fake_torch_npu, layout="BNSD"), reference.attention, [q, k, v]
        )


def test_the_fake_kernels_compressed_mask_equals_its_explicit_full_mask(fake_torch_npu):
    # Two documented routes to causal attention (sparse_mode 2 with the 2048 mask, sparse_mode 0 with a full
    # [S, S] mask and next_tockens=0) agree beyond 2048 tokens: the fake's mask expansion is self-consistent.
    q, k, v = qkv(1, 2200, 1, 1, head_dim=8)
    compressed = _kernel(fake_torch_npu, q, k, v)
    full_mask = torch.ones(2200, 2200, dtype=torch.bool).triu(1)
    explicit = fake_torch_npu.npu_fusion_attention(
        q, k, v, 1, "BSND", atten_mask=full_mask, scale=8**-0.5, pre_tockens=65536, next_tockens=0, sparse_mode=0
    )[0]
    torch.testing.assert_close(compressed, explicit, atol=1e-6, rtol=1e-6)


def test_the_fake_kernel_returns_the_documented_seven_outputs(fake_torch_npu):
    q, k, v = qkv(2, 12, 4, 2)
    out = _kernel(fake_torch_npu, q, k, v)
    full = fake_torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=npu_ops.causal_mask(q.device),
                                               scale=0.25, sparse_mode=2)
    assert len(full) == 7 and torch.equal(full[0], out)
    assert full[1].shape == (2, 4, 12, 8) and full[1].dtype == torch.float32  # softmax_max, BNS8


# --- attention within packed documents (TND varlen) --------------------------------------------------------------

def _documents(seq: int) -> Documents:
    """Row 0: three documents (one from the window before); row 1: one starting at 0, one near the end."""
    return Documents.from_starts([np.array([seq // 3, seq // 2]), np.array([0, seq - 2])], seq, False)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("seq", [12, 37])
def test_document_attention_through_tnd_matches_the_masked_reference(fake_torch_npu, heads, kv_heads, seq):
    documents = _documents(seq)
    assert_same_forward_and_backward(functools.partial(npu_ops.attention, documents=documents),
                                     functools.partial(reference.attention, documents=documents),
                                     list(qkv(2, seq, heads, kv_heads)))


def test_document_attention_passes_the_loaders_cumulative_ends_as_host_ints_in_one_tnd_call(fake_torch_npu,
                                                                                           monkeypatch):
    seen = []
    kernel = fake_torch_npu.npu_fusion_attention

    def spy(q, k, v, head_num, layout, **kwargs):
        seen.append((tuple(q.shape), layout, kwargs))
        return kernel(q, k, v, head_num, layout, **kwargs)

    monkeypatch.setattr(fake_torch_npu, "npu_fusion_attention", spy)
    documents = _documents(12)
    npu_ops.attention(*qkv(2, 12, 4, 2), documents=documents)
    ((shape, layout, kwargs),) = seen
    assert shape == (24, 4, 16) and layout == "TND"
    assert kwargs["actual_seq_qlen"] == kwargs["actual_seq_kvlen"] == [4, 6, 12, 22, 24]
    assert kwargs["sparse_mode"] == npu_ops.SPARSE_MODE_LEFT_UP_CAUSAL


def test_more_documents_than_one_varlen_call_takes_are_attended_in_several_calls(fake_torch_npu):
    # 1,025 documents of two tokens: the API reference allows at most 1K entries in actual_seq_qlen (the fake refuses
    # more), so the window is cut between documents into calls of at most 1,024.
    documents = Documents.from_starts([np.arange(2, 2050, 2)], 2050, False)
    assert len(documents.cu_seqlens) == 1025
    q, k, v = qkv(1, 2050, 2, 1, head_dim=8)
    with pytest.raises(RuntimeError, match="1025 sequences in actual_seq_qlen, at most 1024"):
        fake_torch_npu.npu_fusion_attention(q[0], k[0], v[0], 2, "TND", actual_seq_qlen=documents.cu_seqlens,
                                            actual_seq_kvlen=documents.cu_seqlens, scale=8**-0.5)
    fake_torch_npu.calls.clear()
    assert_same_forward_and_backward(functools.partial(npu_ops.attention, documents=documents),
                                     functools.partial(reference.attention, documents=documents), [q, k, v])
    assert fake_torch_npu.calls["npu_fusion_attention"] == 2


def test_document_lengths_instead_of_cumulative_ends_are_refused_by_the_kernel(fake_torch_npu):
    q, k, v = (t.reshape(24, -1, 16) for t in qkv(2, 12, 4, 4))
    with pytest.raises(RuntimeError, match="cumulative lengths"):
        fake_torch_npu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=[4, 2, 6, 10, 2],
                                            actual_seq_kvlen=[4, 2, 6, 10, 2], scale=0.25)


# --- ring attention's block kernel on npu_fusion_attention / npu_fusion_attention_grad ---------------------------

BLOCK_CASES = {  # heads, key/value heads, query rows, key rows, causal, document mask
    "causal": (4, 4, 12, 12, True, False), "causal_gqa": (8, 2, 12, 12, True, False),
    "more_keys": (4, 2, 6, 18, False, False), "more_queries": (4, 1, 18, 6, False, False),
    "documents": (4, 2, 12, 12, False, True), "causal_documents": (4, 2, 12, 12, True, True),
}


def _block_inputs(heads, kv_heads, sq, sk, masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, sq, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, sk, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, heads, sq, 16, generator=g)
    mask = None
    if masked:  # documents of 5 queries against documents of 4 keys: the last queries' document has no key here
        mask = (torch.arange(sq).div(5, rounding_mode="floor")[:, None]
                == torch.arange(sk).div(4, rounding_mode="floor")[None, :])[None, None].expand(2, 1, sq, sk)
    return q, k, v, dout, mask


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_npu_block_kernel_matches_the_math_block_kernel(fake_torch_npu, case):
    heads, kv_heads, sq, sk, causal, masked = BLOCK_CASES[case]
    q, k, v, dout, mask = _block_inputs(heads, kv_heads, sq, sk, masked)
    out, lse = blocks.npu_block_attention(q, k, v, causal, mask)
    want_out, want_lse = blocks.math_block_attention(q, k, v, causal, mask)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)  # -inf where a row sees no key of the block
    # The ring hands the backward the lse merged over every block (finite): here the block's own.
    merged = want_lse.masked_fill(want_lse.isneginf(), 0.0)
    grads = blocks.npu_block_attention_backward(dout, q, k, v, want_out, merged, causal, mask)
    want = blocks.math_block_attention_backward(dout, q, k, v, want_out, merged, causal, mask)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.shape == expected.shape, name
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_npu_block_kernel_runs_one_forward_and_one_grad_kernel_with_the_merged_statistics(fake_torch_npu,
                                                                                         monkeypatch):
    seen = {}
    grad_kernel = fake_torch_npu.npu_fusion_attention_grad

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return grad_kernel(*args, **kwargs)

    monkeypatch.setattr(fake_torch_npu, "npu_fusion_attention_grad", spy)
    q, k, v, dout, _ = _block_inputs(4, 2, 12, 12, False)
    fake_torch_npu.calls.clear()
    out, lse = blocks.npu_block_attention(q, k, v, True)
    blocks.npu_block_attention_backward(dout, q, k, v, out, lse, True)
    assert fake_torch_npu.calls["npu_fusion_attention"] == 1
    assert torch.equal(seen["softmax_max"], lse[..., None].expand(2, 4, 12, 8))
    assert torch.equal(seen["softmax_sum"], torch.ones(2, 4, 12, 8)) and torch.equal(seen["attention_in"], out)
    assert seen["sparse_mode"] == npu_ops.SPARSE_MODE_LEFT_UP_CAUSAL


def test_the_block_kernels_softmax_statistics_are_max_and_sum_of_the_scaled_scores(fake_torch_npu):
    # lse = softmax_max + log(softmax_sum): a wrapper reading them as (sum, max), or the unscaled scores, fails.
    q, k, v, _, _ = _block_inputs(4, 4, 8, 8, False)
    _, softmax_max, softmax_sum = fake_torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25)[:3]
    scores = q @ k.transpose(-2, -1) * 0.25
    torch.testing.assert_close(softmax_max[..., 0], scores.amax(-1))
    torch.testing.assert_close(softmax_max[..., 0] + softmax_sum[..., 0].log(), scores.logsumexp(-1))
    assert softmax_max.shape == (2, 4, 8, 8) and torch.equal(softmax_max, softmax_max[..., :1].expand(-1, -1, -1, 8))


# --- rms_norm ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 1, 16), (3, 37, 64), (2, 5, 7, 24)])
def test_fused_rms_norm_matches_reference(fake_torch_npu, shape):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(shape, generator=g), torch.rand(shape[-1], generator=g) + 0.5
    assert_same_forward_and_backward(
        lambda x, w: npu_ops.rms_norm(x, w, 1e-5), lambda x, w: reference.rms_norm(x, w, 1e-5), [x, w]
    )


def test_fused_rms_norm_casts_an_fp32_weight_to_the_activations_dtype(fake_torch_npu, torch_npu_wheel, monkeypatch):
    # The API reference: gamma's dtype must be the input's. The fp32 weight still gets its gradient, in fp32.
    seen = []
    kernel = torch_npu_wheel._kernels["npu_rms_norm"]
    monkeypatch.setitem(torch_npu_wheel._kernels, "npu_rms_norm",
                        lambda x, gamma, epsilon=1e-6: seen.append(gamma.dtype) or kernel(x, gamma, epsilon))
    x, w = torch.randn(2, 9, 32), (torch.rand(32) + 0.5).requires_grad_()
    got = npu_ops.rms_norm(x.bfloat16(), w, 1e-6)
    assert seen == [torch.bfloat16] and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.rms_norm(x, w, 1e-6), atol=2e-2, rtol=2e-2)
    got.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


@pytest.mark.parametrize("gamma_dtype", [torch.float16, torch.float32])
def test_rms_norm_kernel_refuses_a_gamma_of_another_dtype(fake_torch_npu, gamma_dtype):
    with pytest.raises(RuntimeError, match="gamma dtype"):
        fake_torch_npu.npu_rms_norm(torch.randn(2, 4, 8).bfloat16(), torch.ones(8, dtype=gamma_dtype), epsilon=1e-6)


# --- rotary embedding --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq,heads,kv_heads", [(1, 4, 4), (37, 4, 2), (130, 2, 1)])
def test_fused_rotary_matches_metas_interleaved_reference(fake_torch_npu, seq, heads, kv_heads):
    g = torch.Generator().manual_seed(5)
    xq, xk = torch.randn(2, seq, heads, 16, generator=g), torch.randn(2, seq, kv_heads, 16, generator=g)
    cos, sin = rope_tables(seq, 16)
    assert_same_forward_and_backward(
        lambda q, k: npu_ops.apply_rotary_emb(q, k, cos, sin), lambda q, k: reference.apply_rotary_emb(q, k, cos, sin),
        [xq, xk],
    )
    assert fake_torch_npu.calls["npu_rotary_mul"] >= 2


def test_a_rotary_shape_the_kernel_refuses_takes_the_reference_path(fake_torch_npu, monkeypatch, caplog):
    # Past the limit the kernel documents (B * N < 1000 in interleave mode) the kernel raises RuntimeError.
    monkeypatch.setattr(npu_ops, "ROTARY_INTERLEAVE_MAX_BN", 10**6)
    cos, sin = rope_tables(3, 8)
    xq, xk = torch.randn(250, 3, 4, 8), torch.randn(250, 3, 4, 8)
    got = npu_ops.apply_rotary_emb(xq, xk, cos, sin)
    for a, b in zip(got, reference.apply_rotary_emb(xq, xk, cos, sin), strict=True):
        torch.testing.assert_close(a, b)
    assert "npu_rotary_mul refused B*N=1000, D=8" in caplog.text
    fake_torch_npu.calls.clear()
    npu_ops.apply_rotary_emb(xq, xk, cos, sin)
    assert fake_torch_npu.calls["npu_rotary_mul"] == 0  # remembered: no second try


@pytest.mark.parametrize("fp32", [False, True], ids=["activation-dtype", "model.rope_fp32"])
def test_rope_runs_in_fp32_on_the_npu_when_asked(fake_torch_npu, torch_npu_wheel, monkeypatch, fp32):
    seen = []
    kernel = torch_npu_wheel._kernels["npu_rotary_mul"]
    monkeypatch.setitem(torch_npu_wheel._kernels, "npu_rotary_mul",
                        lambda x, r1, r2, rotary_mode="half", rotate=None:
                        seen.append((x.dtype, r1.dtype)) or kernel(x, r1, r2, rotary_mode, rotate))
    monkeypatch.setattr(npu_ops, "_rope_fp32", False)
    npu_ops.set_rope_fp32(fp32)
    cos, sin = rope_tables(9, 16)
    xq, xk = torch.randn(2, 9, 4, 16), torch.randn(2, 9, 2, 16)
    got = npu_ops.apply_rotary_emb(xq.bfloat16(), xk.bfloat16(), cos, sin)
    want = torch.float32 if fp32 else torch.bfloat16
    assert seen == [(want, want)] * 2 and all(t.dtype == torch.bfloat16 for t in got)
    for a, b in zip(got, reference.apply_rotary_emb(xq, xk, cos, sin), strict=True):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)


def _rotary_half_without_permutation(torch_npu, xq, xk, cos, sin):
    r1 = torch.cat((cos, cos), -1)[None, :, None, :]
    r2 = torch.cat((sin, sin), -1)[None, :, None, :]
    return torch_npu.npu_rotary_mul(xq, r1, r2), torch_npu.npu_rotary_mul(xk, r1, r2)


def _rotary_interleave_with_halves_tables(torch_npu, xq, xk, cos, sin):
    r1 = torch.cat((cos, cos), -1)[None, :, None, :]
    r2 = torch.cat((sin, sin), -1)[None, :, None, :]
    return (torch_npu.npu_rotary_mul(xq, r1, r2, rotary_mode="interleave"),
            torch_npu.npu_rotary_mul(xk, r1, r2, rotary_mode="interleave"))


@pytest.mark.parametrize("broken", [_rotary_half_without_permutation, _rotary_interleave_with_halves_tables],
                         ids=["half-mode-on-interleaved-pairs", "interleave-mode-with-half-layout-tables"])
def test_a_wrong_rotary_layout_fails_the_reference_check(fake_torch_npu, broken):
    cos, sin = rope_tables(11, 16)
    xq, xk = torch.randn(2, 11, 2, 16), torch.randn(2, 11, 2, 16)
    with pytest.raises(AssertionError):
        assert_same_forward_and_backward(
            lambda q, k: broken(fake_torch_npu, q, k, cos, sin),
            lambda q, k: reference.apply_rotary_emb(q, k, cos, sin), [xq, xk],
        )


# --- swiglu ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 1, 8), (2, 37, 48), (3, 5, 4, 10)])
def test_fused_swiglu_matches_reference(fake_torch_npu, shape):
    g = torch.Generator().manual_seed(7)
    gate, up = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    assert_same_forward_and_backward(npu_ops.swiglu, reference.swiglu, [gate, up])
    assert fake_torch_npu.calls["npu_swiglu"] >= 1


def test_swiglu_with_gate_and_up_swapped_fails_the_reference_check(fake_torch_npu):
    gate, up = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    with pytest.raises(AssertionError):
        assert_same_forward_and_backward(
            lambda g, u: fake_torch_npu.npu_swiglu(torch.cat((u, g), -1), dim=-1), reference.swiglu, [gate, up]
        )


# --- without torch_npu -------------------------------------------------------------------------------------------

def test_npu_kernels_without_torch_npu_say_what_to_install():
    from titan_npu.errors import DeviceError

    with pytest.raises(DeviceError, match="install torch_npu"):
        npu_ops.swiglu(torch.randn(2, 4), torch.randn(2, 4))


# --- swiglu_linear: the SwiGLU MLP's input projections and gating ------------------------------------------------

@pytest.mark.parametrize("tokens,fused_weight", [(48, True), (5, False)], ids=["weights-cat", "activations-cat"])
def test_swiglu_linear_matches_reference_and_copies_the_smaller_operand(fake_torch_npu, torch_npu_wheel, monkeypatch,
                                                                        tokens, fused_weight):
    # dim 16, ffn 24: with tokens >= dim the kernel's [gate, up] input is one matmul of the concatenated weights,
    # below that the two projections' outputs are concatenated.
    seen = []
    kernel = torch_npu_wheel._kernels["npu_swiglu"]
    monkeypatch.setitem(torch_npu_wheel._kernels, "npu_swiglu",
                        lambda x, dim=-1: seen.append(x.grad_fn.name()) or kernel(x, dim))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, tokens, 16, generator=g)
    w1, w3 = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    assert_same_forward_and_backward(
        npu_ops.swiglu_linear, lambda x, a, b: reference.swiglu(x @ a.T, x @ b.T), [x, w1, w3])
    assert ("CatBackward0" not in seen[0]) == fused_weight


def test_the_mlp_keeps_w1_and_w3_as_its_parameters_and_runs_one_swiglu_kernel(fake_torch_npu):
    from titan_npu.models.decoder.model import FeedForward
    from titan_npu.ops import set_kernels

    torch.manual_seed(0)
    mlp = FeedForward(16, 24)
    assert [name for name, _ in mlp.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]
    x = torch.randn(2, 20, 16)
    set_kernels("npu")
    fake_torch_npu.calls.clear()
    fused = mlp(x)
    assert fake_torch_npu.calls["npu_swiglu"] == 1
    set_kernels("reference")
    torch.testing.assert_close(fused, mlp(x), atol=1e-5, rtol=1e-5)

"""The chunked gated delta rule against its plain recurrence (fp32, CPU), and documents packed in one row against each
run alone, for the delta rule and the short convolution."""

import pytest
import torch
import torch.nn.functional as F

from titan_npu.ops.delta_rule import chunk_gated_delta_rule, gated_delta_rule, l2_normalise
from titan_npu.ops.short_conv import causal_conv1d_silu

TOL = 1e-5  # max abs difference, fp32, outputs of order 1


def recurrent_gated_delta_rule(q, k, v, g, beta, resets=None):
    """The recurrence itself, one position at a time (the test's reference); resets [B, S] bool zero the state."""
    hk, hv = k.shape[2], v.shape[2]
    q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q = l2_normalise(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalise(k.float())
    batch, seqlen = q.shape[:2]
    state = torch.zeros(batch, hv, k.shape[-1], v.shape[-1])
    out = []
    for t in range(seqlen):
        if resets is not None:
            state = state * (~resets[:, t])[:, None, None, None]
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1)


def _inputs(batch, seqlen, hk=2, hv=4, dk=8, dv=6, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, hk, dk, generator=gen)
    k = torch.randn(batch, seqlen, hk, dk, generator=gen)
    v = torch.randn(batch, seqlen, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, seqlen, hv, generator=gen)) * 0.5
    beta = torch.rand(batch, seqlen, hv, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("seqlen,chunk", [(37, 8), (16, 16), (5, 64)])
def test_the_chunked_form_equals_the_recurrence(seqlen, chunk):
    q, k, v, g, beta = _inputs(2, seqlen)
    chunked = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    assert (chunked - recurrent_gated_delta_rule(q, k, v, g, beta)).abs().max().item() < TOL


def test_the_chunked_gradients_equal_the_recurrences():
    inputs = _inputs(1, 21, requires_grad=True)
    weights = torch.randn(1, 21, 4, 6, generator=torch.Generator().manual_seed(5))
    (chunk_gated_delta_rule(*inputs, chunk_size=8) * weights).sum().backward()
    chunked = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    (recurrent_gated_delta_rule(*inputs) * weights).sum().backward()
    for a, x in zip(chunked, inputs):
        assert (a - x.grad).abs().max().item() < TOL


@pytest.mark.parametrize("boundaries", [[13], [8, 16], [3, 4, 30]])  # inside a chunk, on chunk edges, a 1-token one
def test_packed_documents_equal_each_document_run_alone(boundaries):
    seqlen = 37
    q, k, v, g, beta = _inputs(1, seqlen, seed=3)
    ids = torch.zeros(1, seqlen, dtype=torch.int32)
    for b in boundaries:
        ids[:, b:] += 1
    packed = chunk_gated_delta_rule(q, k, v, g, beta, segments=ids, chunk_size=8)
    resets = torch.zeros(1, seqlen, dtype=torch.bool)
    resets[:, boundaries] = True
    assert (packed - recurrent_gated_delta_rule(q, k, v, g, beta, resets)).abs().max().item() < TOL
    for lo, hi in zip([0, *boundaries], [*boundaries, seqlen]):
        alone = chunk_gated_delta_rule(*(x[:, lo:hi] for x in (q, k, v, g, beta)), chunk_size=8)
        assert (packed[:, lo:hi] - alone).abs().max().item() < TOL
    assert (packed - chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)).abs().max().item() > 1e-2


def test_the_short_convolution_restarts_at_each_document():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 11, 5, generator=gen), torch.randn(5, 4, generator=gen)
    ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 10 + [1]], dtype=torch.int32)
    packed = causal_conv1d_silu(x, weight, ids)
    assert (causal_conv1d_silu(x, weight, torch.zeros_like(ids)) - causal_conv1d_silu(x, weight)).abs().max() < TOL
    for row, cut in ((0, 4), (1, 10)):
        for lo, hi in ((0, cut), (cut, 11)):
            alone = causal_conv1d_silu(x[row:row + 1, lo:hi], weight)
            assert (packed[row:row + 1, lo:hi] - alone).abs().max().item() < TOL


def test_on_the_cpu_the_entry_point_runs_the_reference():
    q, k, v, g, beta = _inputs(1, 9)
    ids = torch.tensor([[0] * 4 + [1] * 5])
    assert torch.equal(gated_delta_rule(q, k, v, g, beta, segments=ids, cu_seqlens=[4, 9]),
                       chunk_gated_delta_rule(q, k, v, g, beta, segments=ids))


def test_the_fast_path_gets_each_document_as_one_varlen_sequence(monkeypatch):
    """flash-linear-attention's varlen contract (one row, cu_seqlens the documents' ends), held to the reference by
    a stand-in that runs each document alone: the batch's rows and documents reach the kernel as documents."""
    from titan_npu.ops import delta_rule

    def varlen(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens):
        assert q.shape[0] == 1 and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        ends = cu_seqlens.tolist()
        parts = [chunk_gated_delta_rule(*(x[:, lo:hi] for x in (q, k, v, g, beta)))
                 for lo, hi in zip(ends[:-1], ends[1:])]
        return torch.cat(parts, dim=1), None

    monkeypatch.setattr(delta_rule, "_fla_chunk", lambda: varlen)
    monkeypatch.setattr(delta_rule, "fla_available", lambda x: True)
    q, k, v, g, beta = _inputs(2, 9)
    ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    fast = gated_delta_rule(q, k, v, g, beta, segments=ids, cu_seqlens=[4, 9, 18])
    assert (fast - chunk_gated_delta_rule(q, k, v, g, beta, segments=ids)).abs().max().item() < TOL
    rows = gated_delta_rule(q, k, v, g, beta)
    assert (rows - chunk_gated_delta_rule(q, k, v, g, beta)).abs().max().item() < TOL

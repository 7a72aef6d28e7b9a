"""The NPU mixture-of-experts kernels (ops/npu.py through the fake torch_npu) give the plain-torch reference's
numbers, forward and backward: the grouped GEMM (whose backward torch_npu lacks, so ours is npu_grouped_matmul for
the input's gradient and npu_grouped_matmul_add_ for the weight's), also past the kernels' 1024 groups a call, the
router's top-k and the token permutation both ways under the wheel's documented index convention; a wrapper with a
wrong weight layout, group type or group count fails."""

from __future__ import annotations

import pytest
import torch
from op_compare import assert_same_forward_and_backward

from titan_npu import ops
from titan_npu.models.moe.args import MoEArgs
from titan_npu.models.moe.layer import MoE
from titan_npu.ops import npu as npu_ops
from titan_npu.ops import reference

BF16_TOL = 2e-2


def grouped_inputs(sizes: list[int], k: int = 16, m: int = 24, seed: int = 0):
    """x [sum(sizes), k] sorted by group, w [groups, m, k] (fp32 values that bf16 holds exactly), offsets: the int32
    cumulative ends."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g).bfloat16().float()
    w = (torch.randn(len(sizes), m, k, generator=g) * k**-0.5).bfloat16().float()
    return x, w, torch.tensor(sizes).cumsum(0).to(torch.int32)


def bf16_grouped_mm(offsets: torch.Tensor):
    """npu_ops.grouped_mm on the bf16 copies of fp32 inputs, its result back in fp32 (gradients flow through)."""
    return lambda x, w: npu_ops.grouped_mm(x.bfloat16(), w.bfloat16(), offsets).float()


def routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """experts [tokens, top_k]: distinct experts per token, drawn at random."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices


# --- grouped GEMM --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[5, 0, 9, 3], [1], [0, 7, 0]], ids=["uneven-with-empty", "one", "mostly-empty"])
def test_grouped_matmul_matches_reference_forward_and_backward(fake_torch_npu, sizes):
    x, w, offsets = grouped_inputs(sizes)
    fake_torch_npu.calls.clear()
    assert_same_forward_and_backward(bf16_grouped_mm(offsets),
                                     lambda x, w: reference.padded_grouped_mm(x, w, offsets), [x, w], tol=BF16_TOL)
    assert fake_torch_npu.calls["npu_grouped_matmul"] == 2  # forward, grad_x (rows)
    assert fake_torch_npu.calls["npu_grouped_matmul_add_"] == 1  # grad_w (the contracted token axis)


def test_the_weight_gradient_is_not_asked_of_a_group_type_atlas_a2_lacks(fake_torch_npu):
    # The API reference: npu_grouped_matmul's group_type is -1 or 0 on Atlas A2; K-axis groups are
    # npu_grouped_matmul_add_'s (group_type 2 only).
    x, w, offsets = grouped_inputs([3, 4])
    with pytest.raises(RuntimeError, match="group_type 2 is not supported on Atlas A2"):
        fake_torch_npu.npu_grouped_matmul([x.t().contiguous().t()], [x], group_list=offsets.long(), split_item=3,
                                          group_type=2)
    grad = torch.randn(7, 24).bfloat16()
    out = fake_torch_npu.npu_grouped_matmul_add_(torch.zeros(2, 24, 16), grad, x.bfloat16(), offsets.long())
    want = torch.stack([grad[:3].float().T @ x[:3], grad[3:].float().T @ x[3:]])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_grouped_matmul_past_1024_groups_splits_into_calls_the_kernels_take(fake_torch_npu):
    sizes = torch.randint(0, 3, (1025,), generator=torch.Generator().manual_seed(4)).tolist()
    x, w, offsets = grouped_inputs(sizes, k=8, m=8)
    with pytest.raises(RuntimeError, match="1025 groups, at most 1024 per call"):
        fake_torch_npu.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=offsets.long(), split_item=3,
                                          group_type=0)
    fake_torch_npu.calls.clear()
    assert_same_forward_and_backward(bf16_grouped_mm(offsets),
                                     lambda x, w: reference.padded_grouped_mm(x, w, offsets), [x, w], tol=BF16_TOL)
    assert fake_torch_npu.calls["npu_grouped_matmul"] == 4  # forward and grad_x, two calls each
    assert fake_torch_npu.calls["npu_grouped_matmul_add_"] == 2


def test_the_kernel_itself_has_no_backward_so_the_wrapper_supplies_it(fake_torch_npu):
    # As on a card: torch_npu registers no autograd for npu_grouped_matmul; backpropagating through the bare
    # kernel gives no gradient (torch warns), which is why ops/npu.py wraps it in an autograd.Function.
    x, w, offsets = grouped_inputs([3, 4])
    x.requires_grad_(True)
    out = fake_torch_npu.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=offsets.long(), split_item=3,
                                            group_type=0)[0]
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        out.sum().backward()
    assert x.grad is None


def test_the_weight_untransposed_gives_wrong_numbers(fake_torch_npu):
    # Square experts (m == k): the kernel cannot see from the shapes that [G, M, K] was passed as [G, K, N].
    x, w, offsets = grouped_inputs([4, 5], k=16, m=16)
    want = reference.padded_grouped_mm(x, w, offsets)
    for weight, right in ((w, False), (w.transpose(1, 2), True)):
        got = fake_torch_npu.npu_grouped_matmul([x], [weight], group_list=offsets.long(), split_item=3,
                                                group_type=0)[0]
        assert torch.allclose(got, want, atol=1e-5) == right


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_grouped_matmul_outside_the_kernels_dtypes_takes_the_reference(fake_torch_npu, dtype):
    # fp32: npu_grouped_matmul takes it, but npu_grouped_matmul_add_ (the weight gradient) takes fp16/bf16 only.
    x, w, offsets = grouped_inputs([2, 3])
    fake_torch_npu.calls.clear()
    got = npu_ops.grouped_mm(x.to(dtype), w.to(dtype), offsets)
    assert fake_torch_npu.calls["npu_grouped_matmul"] == 0
    torch.testing.assert_close(got, reference.padded_grouped_mm(x.to(dtype), w.to(dtype), offsets))


# --- routing: top-k softmax, permute, unpermute ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_softmax_picks_the_references_experts_and_keeps_the_probabilities_gradient(fake_torch_npu, dtype):
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    fake_torch_npu.calls.clear()
    probs, experts = npu_ops.moe_topk_softmax(logits, 2)
    want_probs, want_experts = reference.moe_topk_softmax(logits, 2)
    assert fake_torch_npu.calls["npu_moe_gating_top_k_softmax"] == 1
    assert experts.dtype == torch.int64 and torch.equal(experts, want_experts)
    # The weights are gathered from torch's softmax: values and gradients are the reference's exactly.
    assert_same_forward_and_backward(lambda z: npu_ops.moe_topk_softmax(z, 2)[0].gather(-1, experts),
                                     lambda z: reference.moe_topk_softmax(z, 2)[0].gather(-1, experts),
                                     [logits.float()])
    torch.testing.assert_close(probs, want_probs)


def test_topk_softmax_kernel_values_are_not_renormalised(fake_torch_npu):
    logits = torch.randn(5, 6)
    values, experts, row_idx = fake_torch_npu.npu_moe_gating_top_k_softmax(logits, k=2)
    torch.testing.assert_close(values, torch.softmax(logits, -1).gather(-1, experts.long()))
    assert experts.dtype == row_idx.dtype == torch.int32 and row_idx[1].tolist() == [1, 6]  # j * rows + i


@pytest.mark.parametrize("tokens,n_experts,top_k", [(13, 8, 2), (6, 4, 1), (20, 16, 4)])
def test_permute_and_unpermute_match_reference_forward_and_backward(fake_torch_npu, tokens, n_experts, top_k):
    experts = routing(tokens, n_experts, top_k)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, 32, generator=g).bfloat16()
    weights = torch.rand(tokens, top_k, generator=g).bfloat16()
    fake_torch_npu.calls.clear()
    routed, order = npu_ops.moe_permute(x, experts)
    want_routed, want_order = reference.moe_permute(x, experts)
    assert torch.equal(order, want_order) and torch.equal(routed, want_routed)
    assert_same_forward_and_backward(lambda x: npu_ops.moe_permute(x, experts)[0],
                                     lambda x: reference.moe_permute(x, experts)[0], [x], tol=BF16_TOL)
    rows = torch.randn(tokens * top_k, 32, generator=g).bfloat16()
    assert_same_forward_and_backward(lambda r, w: npu_ops.moe_unpermute(r, order, w),
                                     lambda r, w: reference.moe_unpermute(r.float(), order, w.float()).bfloat16(),
                                     [rows, weights], tol=BF16_TOL)
    assert fake_torch_npu.calls["npu_moe_token_permute"] >= 1 and fake_torch_npu.calls["npu_moe_token_unpermute"] >= 1


def test_the_fake_permutation_follows_the_wheels_documented_example(fake_torch_npu):
    # torch_npu/_op_plugin_docs.py, npu_moe_token_permute's later entry: permuted_tokens[sorted_indices[i]] =
    # tokens[i // topK]; npu_moe_token_unpermute's example passes sorted_indices [0, 4, 5, 1, 2, 6, 7, 3] for these
    # tokens and indices, and gets the tokens back with probs 1/2.
    tokens = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]]).bfloat16()
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]])
    permuted, sorted_indices = fake_torch_npu.npu_moe_token_permute(tokens, indices)
    assert sorted_indices.dtype == torch.int32 and sorted_indices.tolist() == [0, 4, 5, 1, 2, 6, 7, 3]
    assert permuted[:, 0].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    assert torch.equal(permuted[sorted_indices.long()], tokens.repeat_interleave(2, dim=0))
    back = fake_torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.full((4, 2), 0.5).bfloat16())
    assert torch.equal(back, tokens)


def test_the_order_is_the_stable_sort_whatever_the_kernels_index_convention(fake_torch_npu, torch_npu_wheel,
                                                                           monkeypatch):
    # The API reference's earlier entry documents sorted_indices as the stable sort itself (its example
    # [0, 6, 7, 5, 3, 1, 2, 4]): moe_permute's order does not depend on which one the card follows.
    kernel = torch_npu_wheel._kernels["npu_moe_token_permute"]
    monkeypatch.setitem(torch_npu_wheel._kernels, "npu_moe_token_permute",
                        lambda t, i, n=None, p=False: (kernel(t, i, n, p)[0],
                                                       torch.argsort(i.reshape(-1), stable=True).int()))
    experts = routing(9, 6, 2)
    routed, order = npu_ops.moe_permute(torch.randn(9, 8).bfloat16(), experts)
    assert torch.equal(order, torch.argsort(experts.reshape(-1), stable=True))


def test_permute_outside_bf16_takes_the_reference(fake_torch_npu):
    experts = routing(5, 4, 2)
    fake_torch_npu.calls.clear()
    routed, order = npu_ops.moe_permute(torch.randn(5, 8), experts)
    out = npu_ops.moe_unpermute(routed, order, torch.rand(5, 2))
    assert out.shape == (5, 8)
    assert fake_torch_npu.calls["npu_moe_token_permute"] == fake_torch_npu.calls["npu_moe_token_unpermute"] == 0


# --- the MoE layer on the npu kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_the_moe_layer_on_npu_kernels_matches_it_on_the_reference(fake_torch_npu, capacity_factor):
    torch.manual_seed(0)
    moe = MoE(MoEArgs(dim=32, n_experts=8, top_k=2, ffn_dim=16, capacity_factor=capacity_factor))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe = moe.bfloat16()
    x = torch.randn(2, 11, 32).bfloat16()
    results = {}
    for kernels in ("npu", "reference"):
        ops.set_kernels(kernels)
        fake_torch_npu.calls.clear()
        moe.zero_grad()
        out, (counts, prob_sums, dropped) = moe(x)
        out.float().square().sum().backward()
        results[kernels] = (out.float(), counts, moe.router.gate.weight.grad.float(), moe.experts.w1.grad.float())
        if kernels == "npu":  # (capacity routing runs its experts as one batched matmul, not a grouped GEMM)
            grouped = {"npu_grouped_matmul"} if capacity_factor is None else set()
            assert {"npu_moe_gating_top_k_softmax", "npu_moe_token_permute", "npu_moe_token_unpermute",
                    *grouped} <= set(fake_torch_npu.calls)
    for got, want in zip(results["npu"], results["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)

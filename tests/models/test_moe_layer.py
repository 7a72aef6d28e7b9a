"""The MoE layer (models/moe): the grouped GEMM and its batched fallback against a per-expert loop, capacity routing
that drops and counts, the selection-only score bias, and transformers' load-balancing loss."""

import pytest
import torch
import torch.nn.functional as F

from titan_npu import ops
from titan_npu.models.moe.args import MoEArgs
from titan_npu.models.moe.balance import load_balancing_loss, update_score_bias
from titan_npu.models.moe.layer import MoE
from titan_npu.ops import reference

TOL = 1e-5  # fp32, values of unit scale


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def _moe(seed: int = 0, **overrides) -> MoE:
    args = MoEArgs(**{**dict(dim=32, n_experts=6, top_k=2, ffn_dim=16), **overrides})
    torch.manual_seed(seed)
    moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _per_expert_loop(moe: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """The obvious implementation: each expert in turn over its tokens (the first `capacity` of them)."""
    weights, experts, _ = moe.router(x)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(experts == e)  # in token order
        if capacity is not None:
            token, slot = token[:capacity], slot[:capacity]
        h = F.linear(F.silu(F.linear(x[token], w1[e])) * F.linear(x[token], w3[e]), w2[e])
        out = out.index_add(0, token, h * weights[token, slot, None])
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


def _forward_backward(fn, moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return out.detach(), {**grads, "input": x.grad.clone()}


def _assert_same(a, b, tol=TOL):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert (out_a - out_b).abs().max().item() < tol
    for name in grads_b:
        assert (grads_a[name] - grads_b[name]).abs().max().item() < tol, name


@pytest.mark.parametrize("shared", [0, 24], ids=["routed-only", "with-shared-expert"])
def test_the_grouped_gemm_gives_the_per_expert_loop_outputs_and_gradients(shared):
    moe = _moe(shared_ffn_dim=shared)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    assert reference.grouped_mm_supported(x, moe.experts.w1)  # fp32, 16-byte rows: torch._grouped_mm runs
    _assert_same(_forward_backward(lambda x: moe(x)[0], moe, x), _forward_backward(lambda x: _per_expert_loop(moe, x),
                                                                                   moe, x))


def test_the_batched_fallback_gives_the_per_expert_loop_outputs_and_gradients():
    # 30 and 14 fp32 values are not 16-byte multiples: torch._grouped_mm refuses them, the padded bmm runs.
    moe = _moe(dim=30, ffn_dim=14)
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(2))
    assert not reference.grouped_mm_supported(x, moe.experts.w1)
    _assert_same(_forward_backward(lambda x: moe(x)[0], moe, x), _forward_backward(lambda x: _per_expert_loop(moe, x),
                                                                                   moe, x))


def test_bf16_takes_the_grouped_gemm_only_with_aligned_rows_and_agrees_with_fp32():
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(3))
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    offsets = torch.tensor([5, 5, 17, 24], dtype=torch.int32)
    exact = reference.padded_grouped_mm(x, w, offsets)
    assert reference.grouped_mm_supported(x.bfloat16(), w.bfloat16())  # 16 and 8 bf16 values: 32 and 16 bytes
    assert not reference.grouped_mm_supported(x[:, :12].bfloat16(), w[:, :, :12].bfloat16())  # 24-byte rows
    for cols in (16, 12):
        got = reference.grouped_mm(x[:, :cols].bfloat16(), w[:, :, :cols].bfloat16(), offsets).float()
        want = reference.padded_grouped_mm(x[:, :cols], w[:, :, :cols], offsets)
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()  # bf16 rounding of the inputs
    assert (reference.grouped_mm(x, w, offsets) - exact).abs().max().item() < TOL


def test_a_capacity_factor_drops_the_assignments_past_an_experts_capacity_and_counts_them():
    moe = _moe(capacity_factor=1.0)
    with torch.no_grad():  # every token prefers experts 0 and 1: each takes 40 assignments, capacity is 40*2/6 -> 14
        moe.router.gate.weight[:2] += 5 * torch.ones(32)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(5)).abs()
    capacity = moe.args.capacity(40)
    assert capacity == 14
    out, (tokens, _, dropped) = moe(x)
    assert tokens.tolist()[:2] == [40.0, 40.0] and dropped.item() == 2 * (40 - capacity)
    # The kept assignments (the first `capacity` tokens of each expert) are computed as the loop computes them.
    _assert_same(_forward_backward(lambda x: moe(x)[0], moe, x),
                 _forward_backward(lambda x: _per_expert_loop(moe, x, capacity), moe, x))
    assert out[capacity:].abs().max().item() == 0.0  # the later tokens lost both experts: only the residual is left


def test_a_capacity_no_expert_reaches_drops_nothing_and_matches_dropless():
    dropless, capped = _moe(seed=3), _moe(seed=3, capacity_factor=3.0)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(6))
    out, (_, _, dropped) = capped(x)
    assert dropped.item() == 0
    assert (out - dropless(x)[0]).abs().max().item() < TOL


def test_the_score_bias_changes_which_experts_are_chosen_but_not_their_weights():
    moe = _moe(score_bias=True, norm_topk_prob=False)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(7))
    moe.router.score_bias[4] = 10.0  # expert 4 wins every token's choice
    weights, experts, probs = moe.router(x)
    assert (experts == 4).any(dim=1).all()
    assert torch.equal(weights, probs.gather(1, experts))  # the weights are the unbiased probabilities


def test_the_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    bias = torch.zeros(4)
    update_score_bias(bias, torch.tensor([10.0, 2.0, 4.0, 0.0]), rate=0.1)  # mean 4
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])


def test_the_load_balancing_loss_is_transformers_load_balancing_loss_func():
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    gen = torch.Generator().manual_seed(8)
    logits = [torch.randn(30, 6, generator=gen) * 2 for _ in range(3)]
    stats = [(torch.zeros(6).index_add_(0, torch.topk(lg.softmax(-1), 2).indices.flatten(), torch.ones(60)),
              lg.softmax(-1).sum(0)) for lg in logits]
    ours = load_balancing_loss([s[0] for s in stats], [s[1] for s in stats], rows_per_layer=30)
    theirs = qwen3_moe.load_balancing_loss_func(tuple(logits), 6, 2)
    assert abs(ours.item() - theirs.item()) < 1e-6


def test_the_layer_compiles_and_gives_its_eager_outputs_and_gradients():
    moe = _moe(seed=4)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(9))
    compiled = torch.compile(moe, backend="aot_eager")
    _assert_same(_forward_backward(lambda x: compiled(x)[0], moe, x), _forward_backward(lambda x: moe(x)[0], moe, x))


def test_the_layer_runs_on_fake_tensors_as_a_dry_run_does():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # torch._grouped_mm's shape rule there takes only bf16: the padded path runs instead
        moe = _moe()
        out, (tokens, _, _) = moe(torch.randn(40, 32))
        out.sum().backward()
    assert tuple(out.shape) == (40, 32) and tuple(tokens.shape) == (6,)

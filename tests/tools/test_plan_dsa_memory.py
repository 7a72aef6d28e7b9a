"""The planner's memory of DeepSeek Sparse Attention's lightning indexer against what the model allocates on CPU
(torch.profiler's allocator accounting): the per-key tensors a learning indexer keeps for its backward (its scores
against every key of the sequence, the broadcast matmul's per-query key copy, the KL's tensors), its backward's
transient, and the scores a frozen indexer still computes in its forward. Tolerance 10% per term; the whole step's
estimate bounds the measured peak from above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from titan_npu import ops
from titan_npu.config.schema import ModelConfig
from titan_npu.models.deepseek_v3.cost import mla_attention_bytes
from titan_npu.models.deepseek_v32.cost import dsa_attention_bytes, indexer_bytes, indexer_transient_bytes
from titan_npu.models.deepseek_v32.model import LightningIndexer
from titan_npu.models.registry import build_model, build_model_args
from titan_npu.models.spec import CostSite
from titan_npu.ops.reference import head_summed_probs, indexer_kl, indexer_scores, selected_mask, top_keys
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import rank_activations
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.temporaries import temporary_bytes

TOLERANCE = 0.10
BATCH = 2
SHAPES = dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=16, n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, n_groups=4,
              topk_groups=2, first_k_dense=1, index_topk=8)


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def _args(seq: int, heads: int, head_dim: int, weight: float = 1.0):
    return build_model_args(ModelConfig(name="deepseek_v32", flavor="debug", max_seq_len=seq, index_n_heads=heads,
                                        index_head_dim=head_dim, indexer_loss_weight=weight, **SHAPES))


def _allocations(fn) -> tuple[int, int]:
    """(peak, still held at the end) of the bytes `fn` allocates."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak, current


def _attention_bytes(args, seq: int) -> dict[str, int]:
    """A DSA layer's attention (the model's SparseMLA, layer 1 of the model) on [BATCH, seq] tokens: what its
    training forward leaves for backward, its forward's peak beyond that, and its backward's peak beyond it."""
    torch.manual_seed(0)
    model = build_model(args)
    model.train()
    attention = model.layers["1"].attention
    cos, sin = model.freqs_cos, model.freqs_sin
    x = torch.randn(BATCH, seq, args.dim, requires_grad=True)
    kept: dict[str, torch.Tensor] = {}

    def forward() -> None:
        out = attention(x, cos, sin)
        loss = out.float().sum()
        kept["loss"] = loss if attention.indexer_loss is None else loss + attention.indexer_loss

    peak, held = _allocations(forward)
    backward_peak, _ = _allocations(lambda: kept.pop("loss").backward())
    return {"held": held, "forward": peak - held, "backward": backward_peak}


def _indexer_bytes(args, seq: int) -> dict[str, int]:
    """The indexer's own steps as SparseMLA runs them (scores, selection, the KL against the main attention's
    head-summed probabilities) on [BATCH, seq] tokens: its forward's peak and what it leaves, its backward's peak."""
    torch.manual_seed(0)
    indexer = LightningIndexer(args)
    x, latent = torch.randn(BATCH, seq, args.dim), torch.randn(BATCH, seq, args.q_lora_rank)
    cos, sin = torch.randn(seq, args.qk_rope_head_dim // 2), torch.randn(seq, args.qk_rope_head_dim // 2)
    q = torch.randn(BATCH, seq, args.n_heads, args.head_dim)
    k = torch.randn(BATCH, seq, args.n_heads, args.head_dim)
    visible = torch.ones(seq, seq, dtype=torch.bool).tril().expand(BATCH, -1, -1)
    kept: dict[str, torch.Tensor] = {}

    def forward() -> None:
        with torch.set_grad_enabled(args.trains_indexer):
            scores = indexer_scores(*indexer(x, latent, cos, sin))
        keys = selected_mask(top_keys(scores.detach(), visible, args.index_topk), seq)
        if args.trains_indexer:
            kept["loss"] = indexer_kl(head_summed_probs(q, k, keys), scores, keys)

    peak, held = _allocations(forward)
    backward = _allocations(lambda: kept.pop("loss").backward())[0] if kept else 0
    return {"held": held, "forward": peak - held, "backward": backward}


@pytest.mark.parametrize("heads, head_dim, seq", [(4, 32, 64), (16, 32, 64), (4, 64, 128)])
def test_a_learning_indexer_keeps_what_the_planner_counts(heads, head_dim, seq):
    learning, frozen = _args(seq, heads, head_dim), _args(seq, heads, head_dim, weight=0.0)
    # The model's layer: the difference a learning indexer makes to what it keeps (a frozen one keeps nothing).
    got, base = _attention_bytes(learning, seq), _attention_bytes(frozen, seq)
    site = CostSite(4, 1, False, "cpu", seq)
    assert got["held"] - base["held"] == pytest.approx(BATCH * seq * indexer_bytes(learning, site), rel=TOLERANCE)


@pytest.mark.parametrize("heads, head_dim, seq, weight", [(4, 32, 64, 1.0), (16, 32, 64, 1.0), (4, 64, 128, 1.0),
                                                          (4, 32, 64, 0.0), (16, 64, 64, 0.0)])
def test_the_indexers_transient_is_what_the_planner_counts(heads, head_dim, seq, weight):
    args = _args(seq, heads, head_dim, weight)
    got = _indexer_bytes(args, seq)
    site = CostSite(4, 1, False, "cpu", seq)
    # Learning: its backward's peak (gradients of the scores and of the per-query key copy); frozen: scoring every
    # key in its forward, without gradient.
    measured = got["backward"] if weight else got["forward"]
    assert measured == pytest.approx(BATCH * seq * indexer_transient_bytes(args, site), rel=TOLERANCE)


def test_the_step_estimate_counts_the_indexer_and_bounds_the_measured_peak():
    seq = 128
    args = _args(seq, 4, 32)
    torch.manual_seed(0)
    model = build_model(args)
    model.train()
    tokens = torch.randint(0, args.vocab_size, (BATCH, seq))
    labels = torch.randint(0, args.vocab_size, (BATCH, seq))

    def step() -> None:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten()) + model.auxiliary_loss()
        loss.backward()

    step()  # gradients exist from here on
    measured, _ = _allocations(step)
    job = Job(args, seq, "fp32")
    layout = Layout(Degrees(), batch_size=BATCH)
    acts = rank_activations(job, layout, 0, "cpu")
    estimate = acts.saved + temporary_bytes(job, layout, 0, acts.extra, "cpu").backward
    # The indexer's scores against every key dominate this step: without them the estimate falls far below the
    # measured peak; with them it bounds it (the planner's block walk stacks each block's transient on what the
    # whole block holds, and counts the masked attention's probabilities, which torch's CPU kernel does not keep).
    assert measured <= estimate <= 1.3 * measured
    site = CostSite(4, 1, False, "cpu", seq)
    per_layer = BATCH * seq * (dsa_attention_bytes(args, site).saved - mla_attention_bytes(args, site).saved)
    assert estimate - args.n_layers * per_layer < 0.8 * measured


def test_the_planners_kl_target_head_group_is_the_reference_ops():
    """The planner's KL-target transient counts the head group ops/reference.py's head_summed_probs scores at once."""
    import inspect

    from titan_npu.models.deepseek_v32.args import TARGET_HEADS_AT_ONCE

    assert inspect.signature(head_summed_probs).parameters["heads_at_once"].default == TARGET_HEADS_AT_ONCE

"""The planner and dry run for context parallelism: a rank's activations and loss of its seq_len / cp tokens, the
ring's K/V traffic and Ulysses' all-to-alls, FSDP over dp_shard x cp, cp in the layout search with the advice
'this fits only with cp >= N', and plan == dry run for Qwen3-32B at 32K tokens on 16 x 910B."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.errors import LayoutError
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import block_bytes, rank_activations
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Layout, job_from_config, layout_from_config
from titan_npu.planner.perf import context_exchange_seconds, estimate_step
from titan_npu.planner.plan import format_plan
from titan_npu.planner.search import config_for_layout, config_overrides, make_plan
from titan_npu.planner.verify import compare_with_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA_128K = CONFIGS / "llama3_8b_128k.toml"
QWEN3_32B_32K = ["--training.seq_len", "32768", "--model.max_seq_len", "32768", "--training.batch_size", "1",
                 "--training.gradient_accumulation_steps", "1", "--parallel.tp_degree", "1",
                 "--parallel.pp_degree", "1", "--parallel.pp_microbatches", "0"]


def test_a_cp_rank_holds_its_share_of_every_blocks_activations():
    job = job_from_config(load_config(LLAMA_128K))
    whole = block_bytes(job, Layout(Degrees(dp_shard=8)), 1)
    # Besides its share, a cp rank's block keeps wo's copy of attention's output (bf16 q: 4096) and the RoPE rows of
    # its positions (fp32 cos and sin, 4 x head_dim 128) per token.
    extra = 131072 * (2 * 4096 + 4 * 128)
    for cp in (2, 4, 8):
        split = block_bytes(job, Layout(Degrees(dp_shard=8 // cp, cp=cp, cp_mode="ulysses")), 1)
        assert split.full == (whole.full + extra) // cp and split.block_input == whole.block_input // cp


def test_the_rings_fused_block_kernels_hold_no_score_blocks_and_the_plain_math_one_does():
    job = job_from_config(load_config(LLAMA_128K))
    ring = Layout(Degrees(dp_shard=4, cp=2, cp_mode="ring"))
    ulysses = Layout(Degrees(dp_shard=4, cp=2, cp_mode="ulysses"))
    local = 131072 // 2
    for device in ("cpu", "npu", "cuda"):
        # dq (fp32 4096), dk/dv held and received (fp32 2 x 2 x 1024), K/V held and received (bf16 2 x 2 x 1024),
        # one block's gradients (bf16 4096 + 2 x 1024): under the SwiGLU's fp32 gradient (4 x 14336) per token.
        assert 4 * 4096 + 16 * 1024 + 8 * 1024 + 2 * (4096 + 2048) < 4 * 14336
        assert block_bytes(job, ring, 1, device).backward_transient == local * 4 * 14336
        assert rank_activations(job, ring, 0, device) == rank_activations(job, ulysses, 0, device)
    # A device without a fused kernel runs the plain-math block: 3 fp32 [S/cp]^2 blocks per head besides.
    math = block_bytes(job, ring, 1, "xpu").backward_transient
    assert math == local * (4 * 4096 + 16 * 1024 + 8 * 1024 + 2 * (4096 + 2048)) + 32 * local * local * 4 * 3


def test_ring_and_ulysses_traffic_follow_their_formulas():
    job = job_from_config(load_config(LLAMA_128K))
    hw = hardware("910B2")
    tokens = 131072 // 4
    ring = context_exchange_seconds(job, Layout(Degrees(dp_shard=2, cp=4, cp_mode="ring")), hw, 8, tokens, 32)
    # K/V (8 heads of 128, bf16) travel 3 hops in forward and again with their gradients (3 x) in backward.
    assert ring == pytest.approx(3 * 3 * tokens * 2 * 1024 * 2 * 32 / hw.intra_node_bw)
    ulysses = context_exchange_seconds(job, Layout(Degrees(dp_shard=2, cp=4, cp_mode="ulysses")), hw, 8, tokens, 32)
    assert ulysses == pytest.approx(2 * tokens * (2 * 4096 + 2 * 1024) * 2 * 3 / 4 * 32 / hw.intra_node_bw)


def test_hybrid_traffic_is_ulysses_inside_the_group_and_the_ring_between_groups_over_their_links():
    job = job_from_config(load_config(LLAMA_128K))
    hw = hardware("910B2")
    tokens = 131072 // 8
    hybrid = Layout(Degrees(dp_shard=2, cp=8, cp_mode="hybrid", cp_ulysses=2))
    # 2 nodes of 8: the Ulysses pairs stay inside a node, the ring of 4 groups spans the cp group's 8 ranks, which
    # cross the node boundary (cp is inside dp_shard in the mesh: dp_shard 2 x cp 8 = 16 ranks).
    ulysses = 2 * tokens * (2 * 4096 + 2 * 1024) * 2 * 1 / 2 * 32
    ring = 3 * 3 * tokens * 2 * 1024 * 2 * 32
    assert context_exchange_seconds(job, hybrid, hw, 8, tokens, 32) == pytest.approx(
        ulysses / hw.intra_node_bw + ring / hw.intra_node_bw)
    assert context_exchange_seconds(job, hybrid, hw, 4, tokens, 32) == pytest.approx(
        ulysses / hw.intra_node_bw + ring / hw.inter_node_bw)
    with pytest.raises(LayoutError, match="cp_ulysses_degree=3: .* must divide cp_degree=8"):
        Layout(Degrees(dp_shard=2, cp=8, cp_mode="hybrid", cp_ulysses=3))


def test_hybrid_context_parallelism_is_searched_and_plan_equals_dry_run():
    cfg = load_config(CONFIGS / "debug.toml", ["--training.seq_len", "64", "--model.n_layers", "2"])
    plan = make_plan(cfg, 1, 8, hardware("910B2"), top=10**6)
    hybrids = {(c.layout.cp, c.layout.cp_ulysses) for c in plan.ranked if c.layout.cp_mode == "hybrid"}
    assert (4, 2) in hybrids and (8, 4) in hybrids
    hybrid = Layout(Degrees(dp_shard=2, cp=4, cp_mode="hybrid", cp_ulysses=2), batch_size=8)
    chosen = load_config(CONFIGS / "debug.toml", ["--training.seq_len", "64", "--model.n_layers", "2",
                                                  *config_overrides(hybrid).split()])
    assert layout_from_config(chosen, 8).cp_ulysses == 2
    result = dry_run(chosen, 8, 5)
    comparison = compare_with_plan(result, chosen)
    assert result.forward_checked and comparison["match"], comparison["problems"]


def test_fsdp_over_dp_shard_x_cp_pays_the_inter_node_link_when_its_ranks_span_nodes():
    job = job_from_config(load_config(CONFIGS / "qwen3_32b.toml"))
    hw = hardware("910B2")
    # dp_shard 1 x cp 8, tp 2 ranks apart: FSDP's group spans 16 ranks, two nodes of 8 (one node of 16: HCCS).
    # At 40% of peak the compute hides the HCCS traffic whole, so any exposed time is the RoCE link's.
    layout = Layout(Degrees(dp_shard=1, cp=8, cp_mode="hybrid", cp_ulysses=4, tp=2), batch_size=2, grad_accum=64)
    assert estimate_step(job, layout, hw, 16, efficiency=0.4).fsdp_exposed == 0
    assert estimate_step(job, layout, hw, 8, efficiency=0.4).fsdp_exposed > 0


def test_fsdp_shards_over_dp_shard_times_cp_with_cp_innermost():
    cfg = load_config(CONFIGS / "debug.toml", ["--training.seq_len", "64", "--parallel.cp_degree", "2"])
    layout = layout_from_config(cfg, 6)
    assert (layout.dp_shard, layout.cp, layout.fsdp_shards) == (3, 2, 6)
    assert layout.rank_coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "cp": 1, "tp": 0}


def test_plan_advises_the_least_cp_that_fits_when_only_context_parallel_layouts_fit():
    cfg = load_config(LLAMA_128K)
    small = make_plan(cfg, 1, 8, replace(hardware("910B2"), memory_bytes=40 * 10**9))
    assert small.least_cp == 8 and all(c.layout.cp == 8 for c in small.ranked)
    assert "this fits only with context parallelism, cp >= 8" in format_plan(small)
    roomy = make_plan(cfg, 1, 8, hardware("910B2"))
    assert roomy.least_cp == 1 and "fits only with context parallelism" not in format_plan(roomy)


def test_qwen3_32b_at_32k_on_16_cards_plans_context_parallelism_and_dry_runs_to_its_bytes():
    cfg = load_config(CONFIGS / "qwen3_32b.toml", QWEN3_32B_32K)
    plan = make_plan(cfg, 2, 8, hardware("910B2"))
    first = plan.ranked[0].layout
    assert (first.dp_shard, first.cp, first.cp_mode, first.ac) == (4, 4, "ring", "full")
    assert plan.global_batch == 16 and plan.ranked[0].fits
    chosen = config_for_layout(cfg, first)
    result = dry_run(chosen, 16, 13, forward=False)
    comparison = compare_with_plan(result, chosen)
    assert comparison["match"], comparison["problems"]
    assert result.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 3, "cp": 1, "tp": 0}
    overridden = load_config(CONFIGS / "qwen3_32b.toml", [*QWEN3_32B_32K, *config_overrides(first).split()])
    assert layout_from_config(overridden, 16) == first


@pytest.mark.slow
def test_llama3_8b_at_128k_runs_forward_and_backward_under_its_context_parallel_layout_in_the_dry_run():
    cfg = load_config(LLAMA_128K)
    result = dry_run(cfg, 8, 5)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and result.output_shape == (1, 131072 // 2, 128256)
    assert comparison["match"], comparison["problems"]

"""The planner and dry run for GLM-4.5 and Kimi K2: plan == dry run for the debug GLM (MoE under FSDP with expert
parallelism, under FSDP x TP, in two pipeline stages), the shipped GLM-4.5-Air, GLM-4.5 and Kimi K2 configs fit on
the cards their headers name with dry runs equal to the plan (with -m slow: each is the planner's first layout there),
and GLM-4.5's parameters equal a hand count from its published config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.models.registry import build_model_args
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.search import evaluate, make_plan
from titan_npu.planner.verify import compare_with_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["--training.seq_len", "64", "--training.batch_size", "2"]


@pytest.mark.parametrize("overrides", [
    ["--parallel.dp_shard", "4", "--parallel.ep_degree", "2"],
    ["--parallel.dp_shard", "2", "--parallel.tp_degree", "2"],
    ["--parallel.dp_shard", "2", "--parallel.pp_degree", "2", "--parallel.pp_microbatches", "2"]],
    ids=["moe_ep_under_fsdp", "moe_fsdp_tp", "pipeline"])
def test_debug_glm4_moe_plan_equals_dry_run(overrides):
    cfg = load_config(CONFIGS / "debug_glm4_moe.toml", TINY + overrides)
    result = dry_run(cfg, 4, 3)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]


# The shipped configs: (nodes, cards per node of the header), the busiest rank the plan names, (ep, dp_replicate).
CLUSTERS = {"glm4_5_air.toml": (2, 8, 0, (2, 1)), "glm4_5_355b.toml": (16, 8, 120, (8, 1)),
            "kimi_k2_1t.toml": (64, 16, 64, (16, 1))}


@pytest.mark.parametrize("name", list(CLUSTERS))
def test_shipped_configs_fit_and_dry_run_to_the_plans_bytes(name):
    nodes, per_node, rank, (ep, replicas) = CLUSTERS[name]
    cfg = load_config(CONFIGS / name)
    layout = layout_from_config(cfg, nodes * per_node)
    assert (layout.ep, layout.dp_replicate) == (ep, replicas)
    assert evaluate(job_from_config(cfg), layout, hardware("910B2"), per_node, 0.4).fits
    comparison = compare_with_plan(dry_run(cfg, nodes * per_node, rank, forward=False), cfg)
    assert comparison["match"], comparison["problems"]


@pytest.mark.slow  # searches over 16, 128 and 1024 ranks: seconds to minutes
@pytest.mark.parametrize("name", list(CLUSTERS))
def test_shipped_configs_hold_the_planners_first_layout(name):
    nodes, per_node, _, _ = CLUSTERS[name]
    plan = make_plan(load_config(CONFIGS / name), nodes, per_node, hardware("910B2"))
    assert plan.config_candidate is not None and plan.config_candidate.fits, plan.config_error
    assert plan.ranked[0].layout == plan.config_candidate.layout


def test_glm_4_5_parameters_equal_a_hand_count_of_its_config():
    args = build_model_args(load_config(CONFIGS / "glm4_5_355b.toml").model)
    d, q, kv, vocab = 5120, 96 * 128, 8 * 128, 151552
    attention = 2 * d * q + 2 * d * kv + (q + 2 * kv) + 2 * 128  # q, o, k, v; q/k/v biases; q/k norms
    moe = 160 * d + (160 + 1) * 3 * d * 1536  # router, 160 routed + 1 shared expert
    layers = 92 * (attention + 2 * d) + 3 * 3 * d * 12288 + 89 * moe
    assert args.num_params() == 2 * vocab * d + layers + d
    # A token meets the router, its 8 routed experts and the shared one, and the output head (not the embedding).
    active = 92 * (attention + 2 * d) + 3 * 3 * d * 12288 + 89 * (160 * d + (8 + 1) * 3 * d * 1536) + vocab * d + d
    assert args.num_active_params(exclude_embedding=True) == active
    assert round(args.num_params() / 1e9, 1) == 352.8 and round(active / 1e9, 1) == 32.9

"""The planner and dry run for mixture-of-experts models: experts split over the expert-parallel ranks and then by
FSDP as the trainer splits them, the dry run's forward under balanced routing, FLOPs of the active parameters, the
all-to-all in the step time, and plan == dry run for Qwen3-30B-A3B on 8 x 910B."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from titan_npu.commands.plan import main
from titan_npu.config.loader import load_config
from titan_npu.metrics.throughput import flops_per_token
from titan_npu.models.moe.balanced_routing import balanced_rows
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Layout, job_from_config, layout_from_config
from titan_npu.planner.perf import estimate_step
from titan_npu.planner.search import config_overrides, make_plan
from titan_npu.planner.temporaries import temporary_bytes
from titan_npu.planner.verify import compare_with_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MOE = CONFIGS / "debug_moe.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "2", "--model.n_layers", "2"]
QWEN3_30B = CONFIGS / "qwen3_30b_a3b.toml"


def test_experts_split_over_the_ep_ranks_then_fsdp_as_the_dry_run_builds_them():
    # 6 experts over ep 2 (3 per ep rank), then FSDP over the 2 ranks sharing them (2 + 1): dp_shard rank 3 holds
    # 1 expert, where FSDP alone (chunks of 2, 2, 2, 0) would give it none.
    cfg = load_config(MOE, TINY + ["--model.n_experts", "6", "--parallel.ep_degree", "2"])
    result = dry_run(cfg, 4, 3)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert result.parameters["layers.0.feed_forward.experts.w1"]["local_shape"] == [1, 128, 128]
    assert result.forward_checked  # the exchange ran on fake tensors with balanced routing's split sizes


def test_ep_equal_to_dp_shard_leaves_the_experts_to_expert_parallelism_alone():
    cfg = load_config(MOE, TINY + ["--parallel.ep_degree", "4"])
    result = dry_run(cfg, 4, 2)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert result.forward_checked and result.parameters["layers.1.feed_forward.experts.w2"]["local_shape"][0] == 2


# Layouts MoE layers now run with expert parallelism (docs/moe.md "Parallelise"): 4 ranks, a rank to check each.
EP_LAYOUTS = {
    "ep_x_tp": (["--parallel.dp_shard", "2", "--parallel.tp_degree", "2", "--parallel.ep_degree", "2"], 3),
    "ep_x_pp_with_aux_loss": (["--parallel.dp_shard", "2", "--parallel.pp_degree", "2", "--parallel.ep_degree", "2",
                               "--parallel.pp_microbatches", "2"], 1),
    "ep_over_dp_shard_x_cp": (["--parallel.dp_shard", "2", "--parallel.cp_degree", "2", "--parallel.ep_degree", "4"],
                              2),
    "ep_with_hsdp": (["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.ep_degree", "2"], 3),
}


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_expert_parallel_layouts_with_tp_pp_cp_and_hsdp_plan_equals_dry_run(name):
    overrides, rank = EP_LAYOUTS[name]
    cfg = load_config(MOE, TINY + overrides)
    assert cfg.model.router_aux_loss_coef > 0
    result = dry_run(cfg, 4, rank)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert result.forward_checked


def test_balanced_routing_gives_every_expert_its_even_share():
    assert balanced_rows(16, 8) == [2] * 8
    assert balanced_rows(10, 4) == [3, 3, 2, 2]


def test_plan_ranks_the_moe_layouts_parallel_layout_accepts_tp_pp_and_ep_with_them(capsys):
    code = main(["--config", str(MOE), "--nodes", "1", "--devices-per-node", "4", "--json", "--top", "400"])
    report = json.loads(capsys.readouterr().out)
    layouts = [c["layout"] for c in report["ranked"]]
    assert load_config(MOE).model.router_aux_loss_coef > 0  # pipelining with the aux loss is searched too
    assert {lay["ep"] for lay in layouts} == {1, 2, 4}
    assert {lay["tp"] for lay in layouts} == {1, 2} and {lay["pp"] for lay in layouts} >= {1, 2}
    assert any(lay["ep"] > 1 and lay["tp"] > 1 for lay in layouts)
    assert any(lay["ep"] > 1 and lay["pp"] > 1 for lay in layouts)
    assert any(lay["ep"] > 1 and lay["dp_replicate"] > 1 for lay in layouts)
    # parallel/layout.py's rules: EP x TP and EP with HSDP only with ep = dp_shard (x cp).
    for lay in layouts:
        if lay["ep"] > 1 and (lay["tp"] > 1 or lay["dp_replicate"] > 1):
            assert lay["ep"] == lay["dp_shard"] * lay["cp"], lay
    assert code == 0


def test_the_suggested_overrides_select_a_ranked_moe_layout_whatever_ep_the_config_had():
    cfg = load_config(QWEN3_30B, ["--parallel.ep_degree", "8"])
    plan = make_plan(cfg, 1, 8, hardware("910B2"), top=50)
    for layout in (plan.ranked[0].layout, next(c.layout for c in plan.ranked if c.layout.ep > 1)):
        chosen = load_config(QWEN3_30B, ["--parallel.ep_degree", "8", *config_overrides(layout).split()])
        assert layout_from_config(chosen, 8) == layout


def test_moe_compute_counts_active_parameters_and_expert_parallelism_adds_its_all_to_alls():
    job = job_from_config(load_config(QWEN3_30B))
    a, hw = job.args, hardware("910B2")
    base = Layout(Degrees(dp_shard=8), ac="full", batch_size=16)
    dense = estimate_step(job, base, hw, 8, efficiency=0.4)
    tokens = 16 * 4096
    active = flops_per_token(a.num_active_params(exclude_embedding=True), a.n_layers, a.dim, 4096)
    assert dense.compute == pytest.approx(active * tokens * 4 / 3 / (hw.peak_flops * 0.4))
    assert dense.ep_comm == 0
    ep = estimate_step(job, replace(base, degrees=replace(base.degrees, ep=8)), hw, 8)
    # 48 MoE layers; 8 copies of each token's 2048 bf16 values out and back, forward, backward and recompute.
    volume = 6 * 48 * tokens * 8 * 2048 * 2 * 7 / 8
    assert ep.ep_bytes == pytest.approx(volume) and ep.ep_comm == pytest.approx(volume / hw.intra_node_bw)


def test_expert_parallelism_leaves_fsdp_fewer_experts_to_unshard():
    job = job_from_config(load_config(QWEN3_30B))
    base = Layout(Degrees(dp_shard=8), ac="full", batch_size=1)
    # ep 8 = dp_shard: FSDP leaves the experts whole on their ranks, only the dense parameters are unsharded.
    unsharded = [temporary_bytes(job, replace(base, degrees=Degrees(dp_shard=8, ep=ep)), 0, 0).fsdp for ep in (1, 2, 8)]
    assert unsharded[0] > unsharded[1] > unsharded[2]


@pytest.mark.parametrize(("ep", "rank"), [(1, 7), (8, 5)])
def test_qwen3_30b_a3b_on_8_cards_plan_equals_dry_run(ep, rank):
    cfg = load_config(QWEN3_30B, ["--parallel.ep_degree", str(ep)])
    result = dry_run(cfg, 8, rank, forward=False)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert comparison["planner"] == comparison["dry_run"]
    # 48 blocks of 12 parameters (q, k, v, o; q/k norms; 2 block norms; the router; 3 stacked experts) + 3 roots.
    assert len(result.parameters) == 48 * 12 + 3


@pytest.mark.slow
def test_qwen3_30b_a3b_under_ep_8_runs_forward_and_backward_in_the_dry_run():
    cfg = load_config(QWEN3_30B, ["--parallel.ep_degree", "8", "--training.seq_len", "256",
                                  "--training.batch_size", "1"])
    result = dry_run(cfg, 8, 5)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]

"""The planner under optimizer.name = Muon: its state bytes (a momentum buffer on the matrices Muon takes, AdamW's
two moments on the rest) and the bytes a rank gathers to orthogonalise whole matrices equal the dry run's on the
parallelized model, and the step estimate counts that gather."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.models.registry import build_model, build_model_args
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.parameters import checkpoint_bytes, muon_gather_bytes, state_bytes
from titan_npu.planner.perf import estimate_step
from titan_npu.planner.verify import compare_with_plan
from titan_npu.trainer.optimizer import takes_muon

ROOT = Path(__file__).resolve().parents[2]
DEBUG, DEBUG_MOE = ROOT / "configs" / "debug.toml", ROOT / "configs" / "debug_moe.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "4", "--optimizer.name", "Muon"]

# name: (config, world size, rank, overrides)
LAYOUTS = {
    "TP 2 x FSDP 2": (DEBUG, 4, 3, ["--parallel.tp_degree", "2"]),
    "PP 2 x FSDP 2, the output's stage": (DEBUG, 4, 3, ["--parallel.pp_degree", "2"]),
    "Qwen3-MoE EP 2 x FSDP 2 (experts sharded by FSDP over the ranks that share them)": (
        DEBUG_MOE, 4, 1, ["--parallel.ep_degree", "2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_state_and_gather_bytes_equal_the_dry_runs(name):
    config, world, rank, overrides = LAYOUTS[name]
    cfg = load_config(config, TINY + overrides)
    result = dry_run(cfg, world, rank, forward=False)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert comparison["planner"] == comparison["dry_run"]
    assert result.optimizer == "Muon" and result.optimizer_gather_bytes > 0
    # Embeddings, output and norms keep two moments, the matrices Muon takes one.
    assert result.parameter_bytes < result.optimizer_bytes < 2 * result.parameter_bytes


def _muon_numel(cfg) -> int:
    model = build_model(build_model_args(cfg.model))
    return sum(p.numel() for name, p in model.named_parameters()
               if takes_muon(name, p.ndim, cfg.optimizer.muon_exclude))


def test_fsdp_over_two_ranks_gathers_the_other_half_of_every_muon_matrix():
    cfg = load_config(DEBUG, TINY)
    job, layout = job_from_config(cfg), layout_from_config(cfg, 2)
    muon = _muon_numel(cfg)
    assert muon_gather_bytes(job, layout, 0) == 4 * muon // 2
    total = state_bytes(job, layout, 0)
    # One moment per Muon element, two per AdamW element: (muon + 2 (all - muon)) / 2 fp32 values on each rank.
    n = build_model_args(cfg.model).num_params()
    assert total.optimizer == 4 * (muon + 2 * (n - muon)) // 2
    assert checkpoint_bytes(job) == 4 * (n + muon + 2 * (n - muon))


def test_experts_split_over_expert_parallel_ranks_are_never_gathered():
    cfg = load_config(DEBUG_MOE, TINY + ["--parallel.ep_degree", "2"])
    job, layout = job_from_config(cfg), layout_from_config(cfg, 2)
    experts = load_config(DEBUG_MOE, TINY + ["--parallel.ep_degree", "2", "--optimizer.muon_exclude",
                                             "tok_embeddings.*,output.*,*.experts.*"])
    # Only the dense matrices (FSDP-sharded) are gathered: leaving the experts to AdamW changes nothing.
    assert muon_gather_bytes(job, layout, 0) == muon_gather_bytes(job_from_config(experts), layout, 0) > 0


def test_the_step_estimate_counts_muons_gathers_and_adamw_has_none():
    cfg = load_config(DEBUG, TINY)
    job, layout, hw = job_from_config(cfg), layout_from_config(cfg, 8), hardware("910B2")
    muon = estimate_step(job, layout, hw, 8)
    adamw = estimate_step(replace(job, optimizer="adamw"), layout, hw, 8)
    assert adamw.optimizer_comm == 0
    assert muon.optimizer_comm == pytest.approx(muon_gather_bytes(job, layout, 0) / hw.intra_node_bw)
    assert muon.step_time == pytest.approx(adamw.step_time + muon.optimizer_comm)

"""configs/deepseek_v32_671b.toml: DeepSeek-V3.2's sparse stage with learning indexers on the 512 cards its header
names, in the layout the planner ranks first, whose shards the dry run builds to the plan's bytes."""

from __future__ import annotations

from pathlib import Path

from titan_npu.config.loader import load_config
from titan_npu.models.registry import build_model_args
from titan_npu.planner.hardware import hardware

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v32_671b.toml"
NODES, PER_NODE = 64, 8


def test_the_config_is_the_published_model_in_the_sparse_stage_with_learning_indexers():
    cfg = load_config(CONFIG)
    args = build_model_args(cfg.model)
    assert (args.family, args.flavor, args.dsa_stage, args.trains_indexer) == ("deepseek_v32", "V3.2", "sparse", True)
    assert (args.index_n_heads, args.index_head_dim, args.index_topk) == (64, 128, 2048)
    assert args.index_topk < cfg.training.seq_len


def test_the_configs_layout_fits_and_dry_runs_to_the_plans_bytes():
    from titan_npu.planner.dry_run import dry_run
    from titan_npu.planner.layout import job_from_config, layout_from_config
    from titan_npu.planner.search import evaluate
    from titan_npu.planner.verify import compare_with_plan

    cfg = load_config(CONFIG)
    layout = layout_from_config(cfg, NODES * PER_NODE)
    assert (layout.dp_shard, layout.ep, layout.pp, layout.cpu_offload, layout.ac) == (512, 256, 1, True, "full")
    assert evaluate(job_from_config(cfg), layout, hardware("910B2"), PER_NODE, 0.4).fits
    comparison = compare_with_plan(dry_run(cfg, NODES * PER_NODE, 77, forward=False), cfg)
    assert comparison["match"], comparison["problems"]


def test_the_config_holds_the_planners_first_layout_and_nothing_fits_with_the_state_on_the_cards():
    from titan_npu.planner.search import make_plan

    cfg = load_config(CONFIG)
    plan = make_plan(cfg, NODES, PER_NODE, hardware("910B2"))
    assert plan.config_candidate is not None and plan.config_candidate.fits, plan.config_error
    assert plan.ranked[0].layout == plan.config_candidate.layout
    assert all(c.layout.cpu_offload for c in plan.ranked)

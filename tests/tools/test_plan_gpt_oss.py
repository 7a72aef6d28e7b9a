"""The planner and dry run for gpt-oss: plan == dry run for the debug model under FSDP with expert parallelism and
under tensor parallelism, FLOPs that count a sliding layer's window, sink attention's activations counted as eager
attention's, and the layouts the family refuses (context parallelism, tensor with expert parallelism) left out of
the search."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.errors import LayoutError
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import block_bytes
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Layout, job_from_config
from titan_npu.planner.perf import training_flops_per_token
from titan_npu.planner.search import check_layout, config_for_layout, make_plan
from titan_npu.planner.verify import compare_with_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEBUG = CONFIGS / "debug_gpt_oss.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "2"]


@pytest.mark.parametrize("overrides", [["--parallel.dp_shard", "4", "--parallel.ep_degree", "2"],
                                       ["--parallel.dp_shard", "2", "--parallel.tp_degree", "2"]],
                         ids=["ep_under_fsdp", "tp"])
def test_debug_gpt_oss_plan_equals_dry_run(overrides):
    cfg = load_config(DEBUG, TINY + overrides)
    result = dry_run(cfg, 4, 3)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]


def test_flops_count_the_keys_each_layer_sees():
    args = job_from_config(load_config(CONFIGS / "gpt_oss_20b.toml")).args
    active = args.num_active_params(exclude_embedding=True)
    # 12 sliding layers see 128 keys, 12 full ones all 4096; attention is 64 heads of 64 (4096 wide, not dim 2880).
    assert training_flops_per_token(args, 4096) == 6 * active + 12 * 64 * 64 * (12 * 128 + 12 * 4096)


def test_sink_attention_keeps_the_probabilities_as_eager_attention_does():
    job = job_from_config(load_config(DEBUG, TINY))
    assert job.args.use_flash_attention
    fused_asked = block_bytes(job, Layout(), 2).full
    job.args.use_flash_attention = False
    assert fused_asked == block_bytes(job, Layout(), 2).full  # no fused kernel takes a sink


def test_the_search_leaves_out_context_parallelism_and_tensor_with_expert_parallelism():
    cfg = load_config(DEBUG, TINY)
    job = job_from_config(cfg)
    for layout, refusal in [(Layout(Degrees(dp_shard=2, cp=2)), "takes no attention sink"),
                            (Layout(Degrees(dp_shard=2, tp=2, ep=2)), "not split over both")]:
        with pytest.raises(LayoutError, match=refusal):
            check_layout(config_for_layout(cfg, layout), job, layout.degrees)
    layouts = [c.layout for c in make_plan(cfg, 1, 4, hardware("910B2"), top=10**6).ranked]
    assert layouts and all(lay.cp == 1 and (lay.tp == 1 or lay.ep == 1) for lay in layouts)
    assert {2, 4} <= {lay.ep for lay in layouts} and 2 in {lay.tp for lay in layouts}

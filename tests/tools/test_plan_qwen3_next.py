"""The planner and dry run for Qwen3-Next / Qwen3.5: plan == dry run for the debug models (MoE under FSDP with expert
parallelism and under FSDP x TP, dense in two pipeline stages), FLOPs that count the chunked delta rule
in the linear layers and attention in the full ones, activations that count a linear layer's own tensors, and the
layout the family refuses (context parallelism) left out of the search with a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.errors import LayoutError
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import block_bytes, block_costs
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Layout, job_from_config
from titan_npu.planner.perf import training_flops_per_token
from titan_npu.planner.search import check_layout, config_for_layout, make_plan
from titan_npu.planner.verify import compare_with_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["--training.seq_len", "64", "--training.batch_size", "2"]


# Expert parallelism under FSDP with -m slow: the shipped 80B-A3B config's shards (tests/config) and the 2-rank pool's
# run cover it by default.
@pytest.mark.parametrize(("config", "overrides"), [
    pytest.param("debug_qwen3_next.toml", ["--parallel.dp_shard", "4", "--parallel.ep_degree", "2"],
                 marks=pytest.mark.slow),
    ("debug_qwen3_next.toml", ["--parallel.dp_shard", "2", "--parallel.tp_degree", "2"]),
    ("debug_qwen3_5.toml", ["--parallel.dp_shard", "2", "--parallel.pp_degree", "2", "--parallel.pp_microbatches",
                            "2"])], ids=["moe_ep_under_fsdp", "moe_fsdp_tp", "dense_pipeline"])
def test_debug_qwen3_next_plan_equals_dry_run(config, overrides):
    cfg = load_config(CONFIGS / config, TINY + overrides)
    result = dry_run(cfg, 4, 3)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]


def test_flops_count_attention_in_full_layers_and_the_delta_rule_in_linear_ones():
    args = job_from_config(load_config(CONFIGS / "qwen3_next_80b_a3b.toml")).args
    active = args.num_active_params(exclude_embedding=True)
    # 12 full layers of 16 heads of 256; 36 linear layers of 32 value heads, dk = dv = 128, chunks of 64.
    per_head = 2 * 64 * 128 * 2 + 64 * 256 + 3 * 2 * 128 * 128 + 2 * 64 * 128
    assert training_flops_per_token(args, 4096) == 6 * active + 12 * 16 * 256 * 4096 * 12 + 36 * 3 * 32 * per_head
    assert args.state_bytes_per_sequence() == 36 * (32 * 128 * 128 + 3 * (2 * 2048 + 4096)) * 4


def test_a_linear_block_keeps_its_own_tensors_not_attentions():
    job = job_from_config(load_config(CONFIGS / "debug_qwen3_5.toml", TINY))
    attention = next(b for b in block_costs(job) if b.softmax)
    delta = next(b for b in block_costs(job) if not b.softmax)
    full, linear = (block_bytes(job, Layout(), 2, block=b).full for b in (attention, delta))
    assert linear != full
    job.args.linear_n_v_heads *= 2  # more value heads: more state and more per-head tensors in the linear block only
    assert block_bytes(job, Layout(), 2, block=delta).full > linear
    assert block_bytes(job, Layout(), 2, block=attention).full == full


def test_the_search_leaves_out_context_parallelism():
    cfg = load_config(CONFIGS / "debug_qwen3_next.toml", TINY)
    job = job_from_config(cfg)
    layout = Layout(Degrees(dp_shard=2, cp=2))
    with pytest.raises(LayoutError, match="no context-parallel scan"):
        check_layout(config_for_layout(cfg, layout), job, layout.degrees)
    layouts = [c.layout for c in make_plan(cfg, 1, 4, hardware("910B2"), top=10**6).ranked]
    assert layouts and all(lay.cp == 1 for lay in layouts)
    assert {2, 4} <= {lay.ep for lay in layouts} and 2 in {lay.tp for lay in layouts}

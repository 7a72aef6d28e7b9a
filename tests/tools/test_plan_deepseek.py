"""The planner and dry run for DeepSeek-V3: multi-head latent attention's parameters (the family's parameter
table, dense and MoE blocks each with their own), activations and FLOPs, the group-limited router's activations,
the layouts the family refuses left out of the search, and plan == dry run for the debug model under expert
parallelism and for DeepSeek 16B on 8 x 910B."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.errors import LayoutError
from titan_npu.models.deepseek_v3.cost import mla_bytes
from titan_npu.models.moe.cost import moe_ffn_bytes
from titan_npu.models.registry import build_model_args
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import cost_site
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Layout, job_from_config
from titan_npu.planner.parameters import layer_kinds
from titan_npu.planner.perf import training_flops_per_token
from titan_npu.planner.search import check_layout, config_for_layout, make_plan
from titan_npu.planner.verify import compare_with_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEBUG = CONFIGS / "debug_deepseek.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "2"]


def test_dense_and_moe_blocks_hold_their_own_feed_forward_kinds():
    args = build_model_args(load_config(CONFIGS / "deepseek_v3_671b.toml").model)
    dense, moe = layer_kinds(args, 2), layer_kinds(args, 3)
    assert "feed_forward.w1.weight" in dense and not any("experts" in k or "router" in k for k in dense)
    assert "feed_forward.experts.w1" in moe and "feed_forward.w1.weight" not in moe
    assert "attention.wq_a.weight" in moe and "attention.kv_norm.weight" in moe


@pytest.mark.parametrize("overrides", [["--parallel.dp_shard", "4", "--parallel.ep_degree", "2"],
                                       ["--parallel.dp_shard", "2", "--parallel.tp_degree", "2"]],
                         ids=["ep_under_fsdp", "tp"])
def test_debug_deepseek_plan_equals_dry_run(overrides):
    cfg = load_config(DEBUG, TINY + overrides)
    result = dry_run(cfg, 4, 3)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]


def test_the_search_leaves_out_what_the_family_refuses():
    cfg = load_config(DEBUG, TINY)
    job = job_from_config(cfg)
    seq_aux = load_config(DEBUG, TINY + ["--model.seq_aux_loss_coef", "0.0001"])
    mtp = load_config(DEBUG, TINY + ["--model.mtp_depth", "1"])
    for config, layout, refusal in [
            (cfg, Layout(Degrees(dp_shard=2, tp=2, ep=2)), "expert parallelism cannot split"),
            (mtp, Layout(Degrees(dp_shard=2, cp=2)), "multi-token prediction shifts whole sequences"),
            (seq_aux, Layout(Degrees(dp_shard=2, pp=2), batch_size=4), "across pipeline stages")]:
        with pytest.raises(LayoutError, match=refusal):
            check_layout(config_for_layout(config, layout), job_from_config(config), layout.degrees)
    plan = make_plan(cfg, 1, 4, hardware("910B2"), top=10**6)
    layouts = [c.layout for c in plan.ranked]
    assert layouts and all(lay.tp == 1 or lay.ep == 1 for lay in layouts)
    assert {2, 4} <= {lay.ep for lay in layouts} and 2 in {lay.tp for lay in layouts}
    assert any(lay.pp > 1 for lay in layouts) and any(lay.cp > 1 for lay in layouts)  # with the score bias moving
    assert job.args.n_moe_layers == 3


def test_mla_activations_count_the_latents_their_norms_and_wos_narrower_input():
    job = job_from_config(load_config(CONFIGS / "deepseek_v3_671b.toml"))
    # 671B, bf16, one tp rank on the NPU: the 1536 + 512 latents' norms (fp32 input + normalised value, 2 rstd),
    # the up-projections' inputs (bf16) and wo's 128 x 128 input; op-level checkpointing keeps the five
    # projections' outputs besides q and wo's: the latents, the 64-dim RoPE key and wkv_b's 128 x (128 + 128).
    saved, op_saves = mla_bytes(job.args, cost_site(job, Layout(Degrees(dp_shard=8)), "npu"))
    assert saved == 8 * 2048 + 8 + 2 * 2048 + 2 * 128 * 128
    assert op_saves == 2 * (2048 + 64 + 128 * 256)
    # The latents are replicated over tp, the heads split.
    half = mla_bytes(job.args, cost_site(job, Layout(Degrees(dp_shard=4, tp=2)), "npu"))[0]
    assert half == 8 * 2048 + 8 + 2 * 2048 + 2 * 64 * 128


def test_the_group_router_keeps_its_fp32_copy_of_the_input_beside_the_softmax_routers_tensors():
    job = job_from_config(load_config(CONFIGS / "deepseek_v3_671b.toml"))
    saved = moe_ffn_bytes(job.args, cost_site(job, Layout(Degrees(dp_shard=8)), "cpu")).saved
    # 256 fp32 scores, 8 indices and weights, the fp32 input (7168), 8 routed copies, the 2048-wide shared expert.
    routed = 8 * (24 + 2 * 2 * 7168 + 4 * 2 * 2048)
    assert saved == 4 * 256 + 16 * 8 + 4 * 7168 + routed + 4 * 2 * 2048


def test_flops_per_token_use_mla_head_dims_and_the_active_parameters():
    args = build_model_args(load_config(CONFIGS / "deepseek_v3_671b.toml").model)
    active = args.num_active_params(exclude_embedding=True)
    assert 36.6e9 < active < 36.7e9  # 37.6B active with the embedding
    assert training_flops_per_token(args, 4096) == 6 * active + 6 * 61 * 128 * 4096 * (192 + 128)
    # An MTP module adds its attention's FLOPs and its parameters (in the active ones).
    mtp = build_model_args(load_config(CONFIGS / "deepseek_v3_671b.toml", ["--model.mtp_depth", "1"]).model)
    assert training_flops_per_token(mtp, 4096) == (6 * mtp.num_active_params(exclude_embedding=True)
                                                   + 6 * 62 * 128 * 4096 * (192 + 128))

"""The planner with float8 (float8.enable): the same linears and MoE experts (float8.moe_experts) as the real
conversion, float8 GEMMs at their share of the float8 peak, weights all-gathered in 1 byte, and refusals for devices
without float8 tensor cores."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from titan_npu.config.loader import load_config
from titan_npu.errors import ConfigError
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel.float8 import convert_to_float8
from titan_npu.planner import search
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.parameters import float8_expert_kinds, float8_kinds, parameter_kind
from titan_npu.planner.perf import FLOAT8_PEAK_SHARE, estimate_step, float8_expert_flops_share, float8_shares
from titan_npu.planner.temporaries import temporary_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FLOAT8 = ["--float8.enable", "true"]


@pytest.mark.parametrize(("config", "extra"), [
    ("llama3_8b.toml", []),
    ("llama3_1b.toml", ["--float8.recipe", "rowwise"]),
    ("debug_deepseek.toml", ["--float8.auto_filter_small_kn", "false"]),
    ("debug_moe.toml", ["--float8.auto_filter_small_kn", "false", "--float8.filter_fqns", "output,wo"]),
])
def test_the_planner_counts_the_linears_the_conversion_converts(config, extra):
    pytest.importorskip("torchao.float8")
    cfg = load_config(CONFIGS / config, FLOAT8 + extra)
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = spec_of(args).build_model(args)
    converted = convert_to_float8(model, cfg.float8, dp_mode="none")
    assert converted
    assert {parameter_kind(f"{name}.weight") for name in converted} == float8_kinds(job_from_config(cfg))


def _plan_step(cfg, device: str = "H100"):
    job, hw = job_from_config(cfg), hardware(device)
    layout = layout_from_config(cfg, 8)
    return job, layout, hw, estimate_step(job, layout, hw, 8)


def test_float8_makes_the_8b_step_faster_within_its_peak_share():
    bf16 = load_config(CONFIGS / "llama3_8b.toml", ["--parallel.dp_shard", "8"])
    f8 = load_config(CONFIGS / "llama3_8b.toml", ["--parallel.dp_shard", "8", *FLOAT8])
    *_, slow = _plan_step(bf16)
    job, _, hw, fast = _plan_step(f8)
    flop_share, param_share = float8_shares(job)
    # Every linear but the output: attention's score and value matmuls (23% at seq 8192) and the output stay, as do
    # the embedding and output weights (1.05B of 8.0B).
    assert 0.65 < flop_share < 0.75 and 0.8 < param_share < 0.9
    # Amdahl: the float8 share runs at 2 x 0.75 the bf16 rate, the rest as before.
    speedup = 1 / ((1 - flop_share) + flop_share * hw.peak_flops / (hw.peak_float8_flops
                                                                     * FLOAT8_PEAK_SHARE["tensorwise"]))
    assert slow.compute / fast.compute == pytest.approx(speedup, rel=1e-9)
    assert 1.2 < speedup < 1.5


def test_float8_all_gathers_its_weights_in_one_byte():
    cfg = load_config(CONFIGS / "llama3_8b.toml", ["--parallel.dp_shard", "8", *FLOAT8])
    job, layout, _, _ = _plan_step(cfg)
    gathered = temporary_bytes(job, layout, 0, 0).fsdp
    no_gather = replace(job, float8=replace(job.float8, fsdp_float8_all_gather=False))
    rowwise = replace(job, float8=replace(job.float8, recipe="rowwise"))
    plain = replace(job, float8=None)
    assert gathered < temporary_bytes(no_gather, layout, 0, 0).fsdp == temporary_bytes(plain, layout, 0, 0).fsdp
    assert temporary_bytes(rowwise, layout, 0, 0).fsdp == temporary_bytes(plain, layout, 0, 0).fsdp


def test_emulated_float8_is_planned_at_bf16_speed():
    *_, plain = _plan_step(load_config(CONFIGS / "llama3_8b.toml", ["--parallel.dp_shard", "8"]))
    *_, emulated = _plan_step(load_config(CONFIGS / "llama3_8b.toml", ["--parallel.dp_shard", "8", *FLOAT8,
                                                                      "--float8.emulate", "true"]))
    assert emulated.compute == pytest.approx(plain.compute, rel=1e-12)


@pytest.mark.parametrize("device", ["910B2", "A100"])
def test_planning_float8_for_a_device_without_float8_tensor_cores_is_refused(device):
    cfg = load_config(CONFIGS / "llama3_8b.toml", FLOAT8)
    with pytest.raises(ConfigError, match=rf"^float8.enable = true: the {device} has no float8 tensor cores"):
        search.make_plan(cfg, 1, 8, hardware(device))


def test_float8_off_leaves_the_plan_as_it_was():
    cfg = load_config(CONFIGS / "llama3_8b.toml", ["--float8.recipe", "rowwise", "--float8.filter_fqns", "x"])
    assert job_from_config(cfg).float8 is None
    assert float8_shares(job_from_config(cfg)) == (0.0, 0.0)


@pytest.mark.parametrize(("extra", "kinds"), [
    ([], {"feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3"}),
    (["--float8.moe_recipe", "mxfp8", "--model.moe_ffn_dim", "48"], set()),  # 48: not a multiple of MXFP8's 32
    (["--float8.filter_fqns", "output,router.gate,experts"], set()),
])
def test_the_planner_counts_the_experts_the_conversion_converts(extra, kinds):
    pytest.importorskip("torchao.prototype.moe_training")
    cfg = load_config(CONFIGS / "debug_moe.toml", [*FLOAT8, "--float8.moe_experts", "true", *extra])
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = spec_of(args).build_model(args)
    converted = {name for name in convert_to_float8(model, cfg.float8, dp_mode="none") if name.endswith(".experts")}
    assert bool(converted) == bool(kinds) and (not kinds or len(converted) == args.n_moe_layers)
    assert float8_expert_kinds(job_from_config(cfg)) == kinds


def test_float8_experts_speed_the_moe_step_by_their_flop_share():
    base = ["--parallel.dp_shard", "8", *FLOAT8]
    linears = load_config(CONFIGS / "qwen3_30b_a3b.toml", base)
    experts = load_config(CONFIGS / "qwen3_30b_a3b.toml", [*base, "--float8.moe_experts", "true"])
    *_, slow = _plan_step(linears)
    job, _, hw, fast = _plan_step(experts)
    flop_share, _ = float8_shares(job)
    expert_share = float8_expert_flops_share(job)
    # 128 experts top-8 of 768 x 2048 per layer: about half a token's training FLOPs (the rest: attention, the
    # router and the output).
    assert 0.4 < expert_share < 0.55 and float8_expert_flops_share(job_from_config(linears)) == 0.0
    # Amdahl: the experts' share moves from the bf16 rate to 2 x 0.6 of it (rowwise), the linears' stays.
    rest = 1 - flop_share - expert_share
    before = rest + expert_share + flop_share * hw.peak_flops / (hw.peak_float8_flops * FLOAT8_PEAK_SHARE["tensorwise"])
    after = (rest + expert_share * hw.peak_flops / (hw.peak_float8_flops * FLOAT8_PEAK_SHARE["rowwise"])
             + flop_share * hw.peak_flops / (hw.peak_float8_flops * FLOAT8_PEAK_SHARE["tensorwise"]))
    assert slow.compute / fast.compute == pytest.approx(before / after, rel=1e-9)
    assert 1.05 < before / after < 1.2

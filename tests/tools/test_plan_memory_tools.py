"""The planner with optimizer.state_dtype and activation offload: bf16 moments' state bytes equal the dry run's on
the parallelized model (AdamW and Muon, FSDP and pipeline ranks), half of fp32's for AdamW; a config with offload
dry-runs (hooks installed, forward and backward run) and agrees with the plan; the bytes the planner says offload
moves equal, to 10%, what the hooks move in real CPU steps of a dense and a MoE model; on an accelerator those bytes
leave the device's peak (two blocks' worth come back for backward) and their host traffic is charged beyond what
compute hides, on cpu nothing changes; the search tries offload layouts for an accelerator and lists them where
the config turns offload on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_npu import ops
from titan_npu.config.loader import load_config
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel import ParallelDims
from titan_npu.parallel.parallelize import build_model_parts
from titan_npu.planner.activations import part_activations
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.memory import estimate_memory
from titan_npu.planner.parameters import checkpoint_bytes
from titan_npu.planner.perf import estimate_step
from titan_npu.planner.search import candidate_layouts, config_overrides, make_plan
from titan_npu.planner.stages import rank_parts
from titan_npu.planner.verify import compare_with_plan

ROOT = Path(__file__).resolve().parents[2]
DEBUG, DEBUG_MOE = ROOT / "configs" / "debug.toml", ROOT / "configs" / "debug_moe.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "4"]
BF16 = ["--optimizer.state_dtype", "bf16"]
OFFLOAD = ["--activation_checkpoint.offload", "true", "--activation_checkpoint.offload_min_bytes", "0"]

# name: (world size, rank, overrides)
LAYOUTS = {
    "AdamW bf16 moments, FSDP 2": (2, 1, BF16),
    "AdamW bf16 moments, PP 2 x FSDP 2, the output's stage": (4, 3, BF16 + ["--parallel.pp_degree", "2"]),
    "Muon, bf16 moments of its AdamW part, FSDP 2": (2, 0, BF16 + ["--optimizer.name", "Muon"]),
    "activation offload with selective checkpointing, FSDP 2": (
        2, 0, OFFLOAD + ["--activation_checkpoint.mode", "selective"]),
    "activation offload, PP 2 x FSDP 2": (4, 1, OFFLOAD + ["--parallel.pp_degree", "2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_equals_the_dry_run_with_bf16_moments_or_activation_offload(name):
    world, rank, overrides = LAYOUTS[name]
    cfg = load_config(DEBUG, TINY + overrides)
    result = dry_run(cfg, world, rank)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]
    if "AdamW" in name:  # two bf16 moments per fp32 parameter: half its bytes each
        assert result.optimizer_bytes == result.parameter_bytes


def test_bf16_moments_halve_adams_state_and_shrink_the_checkpoint():
    fp32, bf16 = (job_from_config(load_config(DEBUG, TINY + extra)) for extra in ([], BF16))
    layout = layout_from_config(load_config(DEBUG, TINY), 2)
    n = fp32.args.num_params()
    assert estimate_memory(bf16, layout, "npu").optimizer * 2 == estimate_memory(fp32, layout, "npu").optimizer
    assert checkpoint_bytes(fp32) == 12 * n and checkpoint_bytes(bf16) == 8 * n


def _moved_in_a_real_step(config: Path, overrides: list[str]) -> tuple[int, int]:
    """(bytes the hooks moved, the planner's offloaded bytes) for one forward/backward of one process."""
    ops.set_kernels("reference")
    cfg = load_config(config, TINY + OFFLOAD + overrides)
    args = build_model_args(cfg.model)
    _, (model,) = build_model_parts(spec_of(args), cfg, ParallelDims.from_config(cfg.parallel, 1), args,
                                    torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    out = model(tokens[:, :-1])
    logits = out[0] if isinstance(out, tuple) else out
    nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    job, layout = job_from_config(cfg), layout_from_config(cfg, 1)
    (part,) = rank_parts(job.args, layout, 0)
    return model.activation_offload.moved_bytes, part_activations(job, layout, part, "cpu").offloaded


@pytest.mark.parametrize("config, overrides", [
    (DEBUG, []), (DEBUG, ["--activation_checkpoint.mode", "selective"]), (DEBUG_MOE, [])])
def test_the_planners_offloaded_bytes_are_what_the_hooks_move(config, overrides):
    measured, planned = _moved_in_a_real_step(config, overrides)
    assert measured > 0
    assert planned == pytest.approx(measured, rel=0.10)  # the activation model's tolerance (test_plan_calibration)


def test_offload_moves_the_kept_blocks_off_the_device_and_charges_the_traffic_compute_does_not_hide():
    cfg = load_config(DEBUG, ["--training.seq_len", "256", "--training.batch_size", "8"])
    job, plain = job_from_config(cfg), layout_from_config(cfg, 8)
    off = replace(plain, act_offload=True)
    (part,) = rank_parts(job.args, off, 0)
    moved = part_activations(job, off, part, "npu").offloaded
    before, after = estimate_memory(job, plain, "npu"), estimate_memory(job, off, "npu")
    assert moved > 0 and after.activations == before.activations - moved and after.host_activations == moved
    assert after.total < before.total
    # On cpu the host is the device: the same estimate as without offload.
    assert estimate_memory(job, off, "cpu").total == estimate_memory(job, plain, "cpu").total
    # The debug model computes a step in well under the 2 x moved / 25 GB/s its copies take: the rest is exposed.
    hw = hardware("910B3")
    step, base = estimate_step(job, off, hw, 8), estimate_step(job, plain, hw, 8)
    assert step.activation_offload == pytest.approx(2 * moved / hw.host_bw - step.compute)
    assert step.step_time == pytest.approx(base.step_time + step.activation_offload)
    # A large enough compute hides it.
    big = replace(hw, peak_flops=hw.peak_flops / 1e4)
    assert estimate_step(job, off, big, 8).activation_offload == 0


def test_the_search_tries_activation_offload_on_an_accelerator_only():
    cfg = load_config(DEBUG, TINY)
    job, base = job_from_config(cfg), layout_from_config(cfg, 2)
    tried = candidate_layouts(cfg, job, base, 2, 2, 8, offload_activations=True)
    offloaded = [lay for lay in tried if lay.act_offload]
    assert offloaded and {(lay.ac, lay.selective_ops) for lay in offloaded} == {("none", False), ("selective", False)}
    assert not any(lay.act_offload for lay in candidate_layouts(cfg, job, base, 2, 2, 8))
    assert "--activation_checkpoint.offload true" in config_overrides(offloaded[0])


def test_a_plan_lists_offload_layouts_where_the_config_turns_offload_on():
    hw = hardware("910B3")
    plain = make_plan(load_config(DEBUG, []), 1, 4, hw, top=10_000)
    opted = make_plan(load_config(DEBUG, ["--activation_checkpoint.offload", "true"]), 1, 4, hw, top=10_000)
    assert plain.ranked and not any(c.layout.act_offload for c in plain.ranked)
    offloaded = [c for c in opted.ranked if c.layout.act_offload]
    assert offloaded and opted.config_candidate.layout.act_offload
    # The debug model computes a step far faster than its activations cross PCIe: offload ranks below the rest.
    assert opted.ranked[0].layout.act_offload is False

"""With [lora] the planner counts gradients and optimizer state for the adapters alone, and its numbers still equal
the dry run's (every adapter's local shard too) in the layouts that cut adapters differently: FSDP (dim 0 of A and
B), TP (B by rows under column-parallel weights, A by columns under row-parallel ones), TP x FSDP, PP, Muon."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.memory import estimate_memory
from titan_npu.planner.verify import compare_with_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--training.seq_len", "64", "--training.batch_size", "4", "--training.dtype", "bf16"]
LORA = ["--lora.enable", "true", "--lora.rank", "8"]

# name: (world size, rank, overrides on top of the tiny debug run with LoRA)
LAYOUTS = {
    "FSDP over 3 ranks (uneven shards of A's and B's dim 0)": (3, 2, []),
    "TP 2 x FSDP 2, Qwen3": (4, 3, ["--model.name", "qwen3", "--model.flavor", "debug", "--parallel.tp_degree", "2"]),
    "PP 2 x TP 2, attention only": (4, 1, ["--parallel.pp_degree", "2", "--parallel.tp_degree", "2",
                                           "--lora.target_modules", '["wq", "wv"]']),
    "Qwen3-MoE FSDP 2 (adapters on attention, the routed experts frozen)": (
        2, 1, ["--model.name", "qwen3_moe", "--model.flavor", "debug"]),
    "Muon on the adapters, FSDP 2": (2, 0, ["--optimizer.name", "Muon"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_counts_adapter_gradients_and_state_as_the_dry_run(name):
    world, rank, overrides = LAYOUTS[name]
    cfg = load_config(ROOT / "configs" / "debug.toml", TINY + LORA + overrides)
    result = dry_run(cfg, world, rank)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert any(n.endswith(".lora_A") for n in result.parameters)
    # Only the adapters train: gradients are a small part of the parameters.
    assert 0 < result.gradient_bytes < result.parameter_bytes / 4


def test_lora_plan_of_qwen3_8b_needs_a_fraction_of_full_trainings_state():
    cfg = load_config(ROOT / "configs" / "qwen3_8b.toml", [])
    full = estimate_memory(job_from_config(cfg), layout_from_config(cfg, 8), "npu")
    cfg = load_config(ROOT / "configs" / "qwen3_8b.toml", ["--lora.enable", "true", "--lora.rank", "16"])
    lora = estimate_memory(job_from_config(cfg), layout_from_config(cfg, 8), "npu")
    assert lora.parameters > full.parameters  # the frozen weights and the adapters
    assert lora.gradients < full.gradients / 50 and lora.optimizer < full.optimizer / 50

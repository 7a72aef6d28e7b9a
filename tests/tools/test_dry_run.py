"""The dry run builds one rank of a job for real on the meta device, and the planner's exact numbers equal it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_npu.commands import plan as plan_cli
from titan_npu.config.loader import load_config
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.memory import estimate_memory
from titan_npu.planner.verify import compare_with_plan

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ROOT / "configs" / "debug.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "4", "--training.dtype", "bf16"]

# name: (world size, rank, overrides on top of the tiny debug run)
LAYOUTS = {
    "FSDP over 3 ranks (uneven shards), full checkpointing": (
        3, 2, ["--activation_checkpoint.mode", "full"]),
    "HSDP 2 x 2": (4, 3, ["--parallel.dp_replicate", "2"]),
    "TP 2 alone (no data parallelism), the second rank": (2, 1, ["--parallel.tp_degree", "2"]),
    "TP 2 x FSDP 2, op-level selective checkpointing": (
        4, 3, ["--parallel.tp_degree", "2", "--activation_checkpoint.mode", "selective",
               "--activation_checkpoint.selective_ops", "true"]),
    "PP 2 interleaved x FSDP 2, the embedding's stage": (
        4, 1, ["--parallel.pp_degree", "2", "--parallel.pp_schedule", "Interleaved1F1B"]),
    "PP 2 x HSDP 2 x TP 2, every 2nd block checkpointed, the output's stage": (
        8, 6, ["--parallel.pp_degree", "2", "--parallel.tp_degree", "2", "--parallel.dp_replicate", "2",
               "--activation_checkpoint.mode", "selective"]),
    "replicated data parallel (fsdp off)": (2, 1, ["--parallel.fsdp", "false"]),
    "Qwen3 (q/k norms, head_dim apart from dim / n_heads, tied) TP 2 x FSDP 2": (
        4, 3, ["--model.name", "qwen3", "--model.flavor", "debug", "--parallel.tp_degree", "2"]),
    "Qwen3 (tied) in one process: the output stays the embedding's parameter": (
        1, 0, ["--model.name", "qwen3", "--model.flavor", "debug"]),
    "FSDP 3 x CP 2 ring (FSDP over dp_shard x cp flattened, uneven shards)": (6, 5, ["--parallel.cp_degree", "2"]),
    "CP 4 Ulysses, full checkpointing": (
        4, 2, ["--parallel.cp_degree", "4", "--parallel.cp_mode", "ulysses", "--activation_checkpoint.mode", "full"]),
    "Qwen2 (q/k/v biases, tied) TP 2, op-level selective checkpointing": (
        2, 1, ["--model.name", "qwen2", "--model.flavor", "debug", "--parallel.tp_degree", "2",
               "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ops", "true"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_state_bytes_equal_the_dry_runs(name):
    world, rank, overrides = LAYOUTS[name]
    cfg = load_config(DEBUG, TINY + overrides)
    result = dry_run(cfg, world, rank)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked, "the dry run ran forward and backward through every part"
    assert comparison["match"], comparison["problems"]
    assert comparison["planner"] == comparison["dry_run"]
    assert result.parameter_bytes > 0 and result.optimizer_bytes == 2 * result.parameter_bytes  # AdamW


def test_ranks_of_one_layout_hold_different_shards_in_one_process():
    # Two ranks of the same layout one after another: nothing of the first may leak into the second.
    cfg = load_config(DEBUG, TINY)
    first, last = dry_run(cfg, 3, 0), dry_run(cfg, 3, 2)
    assert first.parameters["tok_embeddings.weight"]["local_shape"] == [171, 256]
    assert last.parameters["tok_embeddings.weight"]["local_shape"] == [170, 256]
    assert compare_with_plan(first, cfg)["match"] and compare_with_plan(last, cfg)["match"]


def test_plan_verify_builds_the_rank_and_agrees(capsys):
    code = plan_cli.main(["--config", str(DEBUG), "--nodes", "1", "--devices-per-node", "4", "--device", "A100",
                          "--verify", "--rank", "3", "--json", *TINY, "--parallel.tp_degree", "2"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    verify = report["verify"]
    assert verify["comparison"]["match"] and verify["dry_run"]["rank"] == 3
    assert verify["dry_run"]["parameter_bytes"] == report["config_layout"]["memory_bytes"]["parameters"]


def test_train_py_dry_run_reports_and_agrees(capsys):
    from titan_npu.train import main

    code = main(["--config", str(DEBUG), "--dry-run", "--world-size", "2", "--rank", "1", *TINY])
    out = capsys.readouterr().out
    assert code == 0
    assert "dry run: rank 1 of 2" in out and "every local shard matches the plan" in out


def test_a_compiled_config_dry_runs_uncompiled_and_says_so():
    # In a child process: compiled blocks on fake tensors used to kill the process (exit 139, a segfault).
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(DEBUG), "--dry-run", "--world-size", "2", *TINY,
           "--compile.enable", "true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compile.enable is on: the dry run builds and runs the model uncompiled" in proc.stdout
    assert "every local shard matches the plan" in proc.stdout


def test_llama_70b_on_64_cards_dry_run_finishes_on_cpu_and_matches():
    cfg = load_config(ROOT / "configs" / "llama_70b.toml", [])
    result = dry_run(cfg, 64, 5)
    comparison = compare_with_plan(result, cfg)
    print(f"70B on 64 ranks, rank 5: dry run {result.seconds:.1f}s (build, forward/backward on fake tensors)")
    assert comparison["match"], comparison["problems"]
    assert result.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 5}
    assert len(result.parameters) == 80 * 9 + 3
    assert result.seconds < 300  # a generous guard: ~20 s of CPU on an idle laptop core


@pytest.mark.parametrize("rank,coordinates", [
    (0, {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0}),
    (15, {"pp": 3, "dp_replicate": 0, "dp_shard": 0, "tp": 3}),
], ids=["the V's ends (embedding and output)", "the V's middle"])
def test_qwen3_32b_on_16_cards_dry_run_equals_the_plans_bytes(rank, coordinates):
    cfg = load_config(ROOT / "configs" / "qwen3_32b.toml", [])
    result = dry_run(cfg, 16, rank)
    comparison = compare_with_plan(result, cfg)
    assert comparison["match"], comparison["problems"]
    assert result.coordinates == coordinates
    planned = estimate_memory(job_from_config(cfg), layout_from_config(cfg, 16), "npu", rank=rank)
    assert (planned.parameters, planned.gradients, planned.optimizer) == (
        result.parameter_bytes, result.gradient_bytes, result.optimizer_bytes)
    # 16 of 64 blocks (11 parameters each, the q/k norms included) in two stages of 8 (ZBVZeroBubble's V: rank 0
    # holds the first stage and the last, with the embedding, the final norm and the output; pp rank 3 the middle two).
    assert len(result.parameters) == 16 * 11 + (3 if rank == 0 else 0)


def test_a_layout_the_model_cannot_take_is_refused_before_building():
    cfg = load_config(DEBUG, TINY + ["--parallel.tp_degree", "3"])
    with pytest.raises(LayoutError, match="tp_degree=3"):
        dry_run(cfg, 3, 0)


def test_the_job_size_must_be_known():
    with pytest.raises(ConfigError, match="--world-size"):
        dry_run(load_config(DEBUG, TINY), None, 0)
    with pytest.raises(ConfigError, match="outside a 4-rank job"):
        dry_run(load_config(DEBUG, TINY), 4, 4)

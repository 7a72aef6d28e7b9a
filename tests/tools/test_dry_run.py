"""The dry run builds one rank of a job for real on the meta device, and the planner's exact numbers equal it.

Every dry run here runs in its own Python process (isolate=True, or the train.py / titan-npu commands): DTensor
and DeviceMesh caches outlive a fake process group, so two dry runs must not share a process (nor the test one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from titan_npu.config import load_config
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.tools.dry_run import DryRunResult, compare_with_plan, dry_run

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ROOT / "configs" / "debug.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "4", "--training.dtype", "bf16"]

# name: (world size, rank, overrides on top of the tiny debug run)
LAYOUTS = {
    "FSDP over 3 ranks (uneven shards), full checkpointing": (
        3, 2, ["--activation_checkpoint.mode", "full"]),
    "TP 2 x FSDP 2, op-level selective checkpointing": (
        4, 3, ["--parallel.tp_degree", "2", "--activation_checkpoint.mode", "selective",
               "--activation_checkpoint.selective_ops", "true"]),
    "PP 2 interleaved x FSDP 2, the embedding's stage": (
        4, 1, ["--parallel.pp_degree", "2", "--parallel.pp_schedule", "Interleaved1F1B"]),
    "PP 2 x HSDP 2 x TP 2, every 2nd block checkpointed": (
        8, 6, ["--parallel.pp_degree", "2", "--parallel.tp_degree", "2", "--parallel.dp_replicate", "2",
               "--activation_checkpoint.mode", "selective"]),
}
CLI_LAYOUTS = {
    "HSDP 2 x 2 through titan-npu plan --verify": (4, 3, ["--parallel.dp_replicate", "2"]),
    "replicated data parallel (fsdp off) through train.py --dry-run": (2, 1, ["--parallel.fsdp", "false"]),
}


def _run_cli(name: str) -> dict:
    world, rank, overrides = CLI_LAYOUTS[name]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if "plan" in name:
        cmd = [sys.executable, "-m", "titan_npu.cli", "plan", "--config", str(DEBUG), "--nodes", "1",
               "--devices-per-node", str(world), "--device", "A100", "--verify", "--rank", str(rank), "--json"]
    else:
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(DEBUG), "--dry-run", "--world-size",
               str(world), "--rank", str(rank)]
    proc = subprocess.run(cmd + TINY + overrides, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    return {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def _run_layout(name: str) -> tuple[DryRunResult, dict]:
    world, rank, overrides = LAYOUTS[name]
    cfg = load_config(DEBUG, TINY + overrides)
    result = dry_run(cfg, world, rank, isolate=True)
    return result, compare_with_plan(result, cfg)


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """Every dry run of this module, two at a time (each is its own process)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        layouts = {name: pool.submit(_run_layout, name) for name in LAYOUTS}
        clis = {name: pool.submit(_run_cli, name) for name in CLI_LAYOUTS}
        return {**{n: f.result() for n, f in layouts.items()}, **{n: f.result() for n, f in clis.items()}}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_state_bytes_equal_the_dry_runs(outcomes, name):
    result, comparison = outcomes[name]
    assert result.forward_checked, "the dry run ran forward and backward through every part"
    assert comparison["match"], comparison["problems"]
    assert comparison["planner"] == comparison["dry_run"]
    assert result.parameter_bytes > 0 and result.optimizer_bytes == 2 * result.parameter_bytes  # AdamW


def test_plan_verify_builds_the_rank_and_agrees(outcomes):
    run = outcomes["HSDP 2 x 2 through titan-npu plan --verify"]
    assert run["code"] == 0, run["stderr"][-2000:]
    report = json.loads(run["stdout"])
    verify = report["verify"]
    assert verify["comparison"]["match"] and verify["dry_run"]["rank"] == 3
    assert verify["dry_run"]["parameter_bytes"] == report["config_layout"]["memory_bytes"]["parameters"]


def test_train_py_dry_run_reports_and_agrees(outcomes):
    run = outcomes["replicated data parallel (fsdp off) through train.py --dry-run"]
    assert run["code"] == 0, run["stderr"][-2000:]
    assert "dry run: rank 1 of 2" in run["stdout"] and "every local shard matches the plan" in run["stdout"]


def test_llama_70b_on_64_cards_dry_run_finishes_on_cpu_and_matches():
    cfg = load_config(ROOT / "configs" / "llama_70b.toml", [])
    result = dry_run(cfg, 64, 5, isolate=True)
    comparison = compare_with_plan(result, cfg)
    print(f"70B on 64 ranks, rank 5: dry run {result.seconds:.1f}s (build, forward/backward on fake tensors)")
    assert comparison["match"], comparison["problems"]
    assert result.coordinates == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 5}
    assert len(result.parameters) == 80 * 9 + 3
    assert result.seconds < 300  # a generous guard: ~20 s of CPU on an idle laptop core


def test_a_layout_the_model_cannot_take_is_refused_before_building():
    cfg = load_config(DEBUG, TINY + ["--parallel.tp_degree", "3"])
    with pytest.raises(LayoutError, match="tp_degree=3"):
        dry_run(cfg, 3, 0, isolate=True)


def test_the_job_size_must_be_known():
    with pytest.raises(ConfigError, match="--world-size"):
        dry_run(load_config(DEBUG, TINY), None, 0, isolate=True)
    with pytest.raises(ConfigError, match="outside a 4-rank job"):
        dry_run(load_config(DEBUG, TINY), 4, 4, isolate=True)

"""Helpers of the reliability tests: a tiny run's arguments, free ports, torchrun launches, a checkpoint's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tiny_run import snapshot as snapshot  # re-exported with tiny_args: the reliability tests import them here
from tiny_run import tiny_args as tiny_args

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without distributed / fault variables, on the CPU, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TITAN_FAULT_", "TORCHELASTIC_", "MASTER_", "TORCH_FR_", "TORCH_DISABLE_SHARE_RDZV"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(TITAN_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun_command(nproc: int = 2, max_restarts: int = 0, rdzv: str = "standalone") -> list[str]:
    """torchrun as a guide reader types it, with no extra environment: rdzv "standalone", "static" (the default
    rendezvous, --master_port) or "c10d" (--rdzv-backend c10d on a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5"]
    if rdzv == "standalone":
        return cmd + ["--standalone"]
    from titan_npu.parallel.process_group import free_port

    port = free_port()
    if rdzv == "static":
        return cmd + ["--master_port", str(port)]
    return cmd + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]


def torchrun(args: list[str], nproc: int = 2, max_restarts: int = 0, timeout: float = 240, rdzv: str = "standalone",
             **env: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N --max-restarts K SCRIPT ARGS` in the repository root (see torchrun_command).

    With a TITAN_FAULT_* variable in `env` the script is tests/train_with_faults.py, which installs those faults.
    """
    cmd = [*torchrun_command(nproc, max_restarts, rdzv), train_script(env), *args]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def train_script(env: dict[str, str]) -> str:
    """train.py, or tests/train_with_faults.py when `env` asks for TITAN_FAULT_* faults (then `env` gains the
    PYTHONPATH through which that script, run from tests/, imports this repository's titan_npu)."""
    if not any(name.startswith("TITAN_FAULT_") for name in env):
        return "train.py"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return str(REPO / "tests" / "train_with_faults.py")


def run_train(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def checkpoint_steps(run_dir: Path) -> list[int]:
    from titan_npu.checkpoint import storage

    return [ref.step for ref in storage.list_checkpoints(run_dir / "ckpt")]


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a checkpoint directory, read in this process."""
    from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata

    metadata = read_metadata(checkpoint)
    keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    return load_tensors(checkpoint, metadata, keys)


def records(run_dir: Path) -> list[dict]:
    """The training records of a run's metrics.jsonl (every attempt appends to it)."""
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]

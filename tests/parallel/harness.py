"""Tiny training runs for the parallelism tests: seed weights, a token file, and pools of gloo ranks that run many
layouts one after another in the same processes (one process group per pool)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from titan_npu.parallel.process_group import free_port

STEPS = 10
BATCH = 4  # per data-parallel rank
MODEL = {"name": "llama3", "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
         "max_seq_len": 64}


@dataclass
class Case:
    """One training run: its name, its overrides on top of the tiny run, and the reference batch it must match."""

    name: str
    overrides: list[str] = field(default_factory=list)
    reference: str = "ref_b4"


def write_tokens(path: Path, n_docs: int = 120, seed: int = 0) -> Path:
    """A tokens .jsonl ({"tokens": [...]} per line) of random documents, enough for 10 steps of 16 sequences."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n_docs):
            tokens = rng.integers(0, 256, size=int(rng.integers(40, 160))).tolist()
            f.write(json.dumps({"tokens": tokens}) + "\n")
    return path


def write_seed_weights(path: Path, seed: int = 1234) -> Path:
    """Full weights of the tiny model from one process: every layout starts from exactly these."""
    from titan_npu.config.schema import ModelConfig
    from titan_npu.models.llama import Transformer, build_model_args

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Transformer(build_model_args(ModelConfig(**MODEL)))
        model.init_weights()
    torch.save(model.state_dict(), path)
    return path


def tiny_run(workdir: Path, name: str, batch_size: int = BATCH) -> list[str]:
    """Overrides of a 10-step fp32 deterministic run from the seed weights, logging every step to workdir/name."""
    args = [f"--model.{key}={value}" for key, value in MODEL.items()]
    args += [
        "--training.seq_len=32", f"--training.batch_size={batch_size}", f"--training.max_steps={STEPS}",
        "--training.dtype=fp32", "--training.deterministic=true", "--training.seed=7",
        "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=3",
        f"--data.path={workdir / 'tokens.jsonl'}", "--data.tokenizer=byte", "--data.num_workers=0",
        f"--checkpoint.initial_load={workdir / 'seed.pt'}", "--checkpoint.enable=false",
        f"--metrics.log_dir={workdir / name}", "--metrics.log_interval=1", "--metrics.tensorboard=false",
        "--metrics.report=false", "--metrics.progress=lines",
        # A fixed peak skips measuring the CPU's matmul peak (seconds per process, and MFU is not under test).
        "--metrics.peak_tflops=1",
    ]
    return args


def losses(workdir: Path, name: str, key: str = "loss") -> list[float]:
    """The per-step losses (or another logged number, e.g. grad_norm) of a run, from its metrics.jsonl."""
    return list(losses_by_step(workdir, name, key).values())


def losses_by_step(workdir: Path, name: str, key: str = "loss") -> dict[int, float]:
    """step -> loss (or `key`) of a run, from its metrics.jsonl."""
    lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r[key] for r in records if "loss" in r and "step" in r}


def _train(args: list[str]) -> None:
    from titan_npu.config import load_config
    from titan_npu.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    trainer.train()
    # Not trainer.close(): the process group stays up for the pool's next case.
    trainer.checkpointer.close()
    trainer.metrics.close()


def _worker(rank: int, world: int, port: int, runs: list[list[str]]) -> None:
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    os.environ["TITAN_DEVICE"] = "cpu"
    torch.set_num_threads(1)  # several ranks share two cores
    try:
        for args in runs:
            _train(args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_pool(world: int, runs: list[list[str]]) -> None:
    """Run the training runs one after another in `world` spawned processes; raises if any rank fails."""
    mp.spawn(_worker, args=(world, free_port(), runs), nprocs=world, join=True)

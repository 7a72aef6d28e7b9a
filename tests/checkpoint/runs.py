"""Tiny training runs for the checkpoint tests: one process in-process, or N gloo processes via spawn."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from ranks import spawn_ranks
from tiny_run import tiny_args

# Fixed tokens to compare models by their logits.
PROBE = torch.arange(64).remainder(512).reshape(2, 32)


def overrides(tmp: Path, name: str, **extra: object) -> list[str]:
    """The tiny run logging to tmp/<name>/logs and checkpointing to tmp/<name>/ckpt, plus --section.key extras."""
    return tiny_args(tmp / name, **extra)


def losses(tmp: Path, name: str) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl."""
    lines = (tmp / name / "logs" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def copy_checkpoint(tmp: Path, source: str, step: int, target: str) -> None:
    """Put one checkpoint of run `source` alone into run `target`'s checkpoint dir (a run cut short there)."""
    dst = tmp / target / "ckpt"
    dst.mkdir(parents=True)
    shutil.copytree(tmp / source / "ckpt" / f"step-{step}", dst / f"step-{step}")


def run_here(args: list[str], probe_out: Path | None = None, compare_to: tuple[Path, Path] | None = None,
             train: bool = True, then_compare_to: tuple[Path, Path] | None = None, then_probe_out: Path | None = None):
    """Build a Trainer in this process (it resumes / initial_loads), check it, train, check again; returns it.

    probe_out / then_probe_out: rank 0 writes the model's logits on PROBE there before / after training.
    compare_to / then_compare_to: (checkpoint, report) before / after training: the checkpoint whose model and
    optimizer tensors this rank's parts must equal; the mismatches go to <report>.rank<R>.json.
    """
    from titan_npu import ops
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    ops.set_kernels("reference")
    trainer = Trainer(load_config(None, args))
    rank = int(os.environ.get("RANK", "0"))
    try:
        for when, probe, target in (("start", probe_out, compare_to), ("end", then_probe_out, then_compare_to)):
            if when == "end" and train:
                trainer.train()
            if probe is not None:
                write_probe(trainer.model, probe)
            if target is not None:
                checkpoint, report = target
                Path(f"{report}.rank{rank}.json").write_text(json.dumps(mismatches_with_checkpoint(trainer,
                                                                                                   checkpoint)))
    finally:
        trainer.close()
    return trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def mismatches_with_checkpoint(trainer, checkpoint: Path) -> dict:
    """Names of this rank's parameters / optimizer moments that differ from the checkpoint's (and counts)."""
    from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata

    metadata = read_metadata(checkpoint)
    saved = load_tensors(checkpoint, metadata, [k for k in metadata.state_dict_metadata
                                                if k.startswith(("model.", "optimizer.state."))
                                                and hasattr(metadata.state_dict_metadata[k], "size")])
    optimizers = getattr(trainer.optimizer, "optimizers", [trainer.optimizer])
    bad, checked = [], 0
    for part, optimizer in zip(trainer.model_parts, optimizers):
        for name, param in part.named_parameters():
            checked += 1
            if not torch.equal(_full(param), saved[f"model.{name}"]):
                bad.append(name)
            for slot, value in optimizer.state[param].items():
                checked += 1
                if not torch.equal(_full(value), saved[f"optimizer.state.{name}.{slot}"]):
                    bad.append(f"{name}.{slot}")
    return {"checked": checked, "mismatched": bad}


def write_probe(model: torch.nn.Module, out: Path) -> None:
    # Every rank runs the forward (FSDP / TP gather collectively); rank 0 writes.
    with torch.no_grad():
        out_logits = _full(model(PROBE)).clone()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(out_logits, out)


def _worker(rank: int, world: int, ports: list[int], jobs: list[dict]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      TITAN_DEVICE="cpu")
    torch.set_num_threads(1)  # two processes on two cores
    for port, job in zip(ports, jobs):
        if rank == 0:
            # The other ranks wait in the next run's rendezvous, which rank 0 hosts, until this is done.
            if job.get("copy") is not None:
                copy_checkpoint(*job["copy"])
            if job.get("export") is not None:
                from titan_npu.checkpoint.export import export_checkpoint

                source, output = job["export"]
                export_checkpoint(source, output, "pt", torch.float32)
        os.environ["MASTER_PORT"] = str(port)
        run_here(job["args"], job.get("probe"), job.get("compare_to"), job.get("train", True),
                 job.get("then_compare_to"), job.get("then_probe"))


def run_distributed(world: int, jobs: list[dict]) -> None:
    """Run training jobs one after another in the same `world` gloo processes (spawned once); raises on failure.

    A job: {"args": overrides, "probe" / "then_probe": path, "compare_to" / "then_compare_to": (checkpoint, report),
    before / after training, "copy": copy_checkpoint arguments to apply first, "export": (checkpoint, .pt) to
    write first, "train": False to only build the Trainer}; all but args optional. See run_here.
    """
    from titan_npu.parallel.process_group import free_port

    ports = [free_port() for _ in jobs]
    spawn_ranks(_worker, (world, ports, jobs), world)

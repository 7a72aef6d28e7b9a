"""Pipeline bubble on the CPU: each schedule's idle time per rank per step in a 2-rank gloo run, against 1F1B at the
same micro-batch count.

    OMP_NUM_THREADS=1 python benchmarks/pp_bubble.py                          # 1F1B, Interleaved1F1B, ZBV, DualPipeV
    OMP_NUM_THREADS=1 python benchmarks/pp_bubble.py --microbatches 4 --repeats 5 --steps 6

Two processes (pp 2, one intra-op thread each, the trainer's own pipeline and torch's schedules) train a Llama of
--layers blocks; every repeat builds each schedule's trainer in turn (order rotated by one each repeat), runs
--warmup steps, then times --steps pipeline steps. A rank's busy time is what its stages compute (forward, input and
weight backward, the loss); its idle time is the rest of the step (waiting for the other rank's activations or
gradients: the bubble, plus the transfers, which are small on one host). The figures are medians over the repeats
of each rank's idle seconds per step and idle share of the step, and the paired ratios (schedule idle / 1F1B idle,
taken within each repeat, so load on a shared machine moves both sides alike).
CPU runs show the schedules' structure, not accelerator speed: a CPU core has no separate communication engine and
DualPipeV's paired forward and backward run one after the other here (torch's default, no overlap callback).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
# The stages' compute calls, by what they compute: forward, backward (full, or the input step of a split one), weight.
COMPUTE = {"forward_one_chunk": "forward", "backward_one_chunk": "backward", "backward_weight_one_chunk": "weight"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(args: argparse.Namespace, workdir: Path, name: str, schedule: str) -> list[str]:
    return [
        "--model.name=llama3", f"--model.dim={args.dim}", f"--model.n_layers={args.layers}", "--model.n_heads=8",
        "--model.n_kv_heads=4", "--model.vocab_size=512", f"--model.max_seq_len={args.seq_len}",
        f"--training.seq_len={args.seq_len}", f"--training.batch_size={args.microbatches}",
        f"--training.max_steps={args.warmup + args.steps}", "--training.dtype=fp32", "--training.seed=7",
        "--parallel.pp_degree=2", f"--parallel.pp_schedule={schedule}",
        f"--parallel.pp_microbatches={args.microbatches}",
        f"--data.path={workdir / 'tokens.jsonl'}", "--data.tokenizer=byte", "--data.num_workers=0",
        "--checkpoint.enable=false", f"--metrics.log_dir={workdir / name}", "--metrics.log_interval=1000",
        "--metrics.tensorboard=false", "--metrics.report=false", "--metrics.progress=lines",
        "--metrics.peak_tflops=1",
    ]


class Meter:
    """Seconds this rank's stages spend computing, wrapped around the stages' and the schedule's compute calls."""

    def __init__(self, pipeline) -> None:
        self.busy = 0.0
        self.by_kind: dict[str, list[float]] = {}  # forward / backward (full or input) / weight / loss: [s, calls]
        for stage in pipeline.stages:
            for name, kind in COMPUTE.items():
                setattr(stage, name, self._timed(getattr(stage, name), kind))
        pipeline.schedule._maybe_compute_loss = self._timed(pipeline.schedule._maybe_compute_loss, "loss")

    def _timed(self, fn, kind: str):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds = time.perf_counter() - t0
                self.busy += seconds
                total = self.by_kind.setdefault(kind, [0.0, 0])
                total[0] += seconds
                total[1] += 1
        return timed


def _measure(args: argparse.Namespace, workdir: Path, name: str, schedule: str) -> list[tuple[float, float]]:
    """(step seconds, busy seconds) of this rank for each timed step."""
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    trainer = Trainer(load_config(None, _overrides(args, workdir, name, schedule)))
    pipeline = trainer.pipeline
    meter = Meter(pipeline)
    data = iter(trainer.dataloader)
    steps = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            meter.by_kind = {}
        dist.barrier()
        busy0, t0 = meter.busy, time.perf_counter()
        trainer.train_step(data)
        if i >= args.warmup:
            steps.append((time.perf_counter() - t0, meter.busy - busy0))
    trainer.checkpointer.close()
    trainer.metrics.close()
    return {"steps": steps, "per_call_ms": {k: 1000 * s / n for k, (s, n) in meter.by_kind.items()}}


def _rank(rank: int, port: int, args: argparse.Namespace, workdir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)
    results: dict[str, list] = {s: [] for s in args.schedules}
    for repeat in range(args.repeats):
        order = args.schedules[repeat % len(args.schedules):] + args.schedules[:repeat % len(args.schedules)]
        for schedule in order:
            results[schedule].append(_measure(args, Path(workdir), f"r{repeat}_{schedule}", schedule))
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def summarize(per_rank: list[dict[str, list]], schedules: list[str]) -> dict:
    """Medians over the repeats of each rank's idle seconds and share per step, and the paired idle ratios."""
    summary = {}
    for schedule in schedules:
        rows = []
        for rank, results in enumerate(per_rank):
            runs = [run["steps"] for run in results[schedule]]
            idle = [statistics.median(s - b for s, b in steps) for steps in runs]
            share = [statistics.median((s - b) / s for s, b in steps) for steps in runs]
            step = [statistics.median(s for s, _ in steps) for steps in runs]
            base = [statistics.median(s - b for s, b in run["steps"]) for run in results[schedules[0]]]
            kinds = results[schedule][0]["per_call_ms"]
            rows.append({"rank": rank, "step_s": statistics.median(step), "idle_s": statistics.median(idle),
                         "idle_share": statistics.median(share),
                         "idle_vs_first": statistics.median(i / b for i, b in zip(idle, base, strict=True)),
                         "per_call_ms": {k: statistics.median(run["per_call_ms"][k] for run in results[schedule])
                                         for k in kinds}})
        summary[schedule] = rows
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), help="the first is the baseline")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        rng = np.random.default_rng(0)
        with open(Path(workdir) / "tokens.jsonl", "w") as f:
            for _ in range(400):
                f.write(json.dumps({"tokens": rng.integers(0, 256, size=int(rng.integers(100, 600))).tolist()}) + "\n")
        out = Path(workdir) / "result.json"
        mp.spawn(_rank, args=(_free_port(), args, workdir, str(out)), nprocs=2, join=True)
        summary = summarize(json.loads(out.read_text()), args.schedules)
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"pp 2, {args.microbatches} micro-batches, llama {args.layers} x {args.dim}, seq {args.seq_len}; medians of "
          f"{args.repeats} repeats x {args.steps} steps")
    print(f"{'schedule':<16} {'rank':>4} {'step s':>8} {'idle s':>8} {'idle %':>7} {'idle / ' + args.schedules[0]:>12}"
          "  ms per call (forward, backward: full or input, weight, loss)")
    for schedule, rows in summary.items():
        for r in rows:
            calls = " ".join(f"{k} {v:.1f}" for k, v in r["per_call_ms"].items())
            print(f"{schedule:<16} {r['rank']:>4} {r['step_s']:>8.4f} {r['idle_s']:>8.4f} "
                  f"{100 * r['idle_share']:>6.1f}% {r['idle_vs_first']:>12.2f}  {calls}")


if __name__ == "__main__":
    main()

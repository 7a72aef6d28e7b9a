"""Peak memory of a context-parallel training step on CPU, measured per rank, next to the planner's estimate.

    python benchmarks/cp_memory.py                                  # configs/debug.toml at seq 8192, cp 1, 2, 4
    python benchmarks/cp_memory.py --cp 1 2 4 8 --seq-len 16384 --config configs/debug.toml
    python benchmarks/cp_memory.py --cp-mode ulysses

Each case runs cp processes (gloo, one data-parallel rank: FSDP over the cp ranks, as the trainer lays it out),
builds the model with the trainer's own parallelize and materialise steps, and runs one warm-up step (forward with
the rank's load-balanced chunks, the chunked loss, backward, so gradients exist) and then one measured step.

What is compared: torch's own CPU allocator accounting, not the process's resident memory. The profiler
(profile_memory=True) records every allocation and free of the measured step; their running sum peaks at what the
step adds on top of what existed before it (the parameter shards and their gradients). The planner's
figure for the same quantity is the rank's saved activations plus its backward temporaries (the loss's or a
recomputed block's buffers, FSDP's unsharded parameters and gradients): rank_activations + temporary_bytes. The
resident memory the trainer logs (mem_peak_gb) also holds the interpreter, torch's libraries and the allocator's
cached pages, about 0.35 GB of it before the model exists, which no tensor estimate can see.
The largest rank's figures are printed (the ranks of a case differ by FSDP's uneven shards at most).
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_npu import ops
from titan_npu.config.loader import load_config

ROOT = Path(__file__).resolve().parents[1]

GiB = 1024**3


def overrides(seq_len: int, cp: int, cp_mode: str) -> list[str]:
    """The config changes of a case: one sequence of seq_len tokens per step, split over cp ranks."""
    return ["--training.seq_len", str(seq_len), "--model.max_seq_len", str(seq_len), "--training.batch_size", "1",
            "--training.gradient_accumulation_steps", "1", "--parallel.cp_degree", str(cp),
            "--parallel.cp_mode", cp_mode, "--parallel.dp_shard", "1"]


def planned_bytes(config: str, seq_len: int, cp: int, cp_mode: str) -> int:
    """The planner's activations + backward temporaries of rank 0 of the case."""
    from titan_npu.planner.activations import rank_activations
    from titan_npu.planner.layout import job_from_config, layout_from_config
    from titan_npu.planner.temporaries import temporary_bytes

    cfg = load_config(config, overrides(seq_len, cp, cp_mode))
    job, layout = job_from_config(cfg), layout_from_config(cfg, cp)
    acts = rank_activations(job, layout, 0, "cpu")
    return acts.saved + temporary_bytes(job, layout, 0, acts.extra, "cpu").during_backward


def peak_of_step(step) -> int:
    """Peak bytes the CPU allocator holds during step() beyond what existed before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def _rank(rank: int, cp: int, port: int, config: str, seq_len: int, cp_mode: str, out: dict) -> None:
    """One cp rank of a case: build, warm up, measure; rank 0 collects every rank's peak into `out`."""
    import contextlib

    from titan_npu.models.registry import build_model_args, spec_of
    from titan_npu.parallel.context_parallel import ContextParallelBatch
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.parallelize import build_model_parts
    from titan_npu.trainer.loss import model_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.set_num_threads(1)
    ops.set_kernels("reference")  # the ops the planner's activation model describes
    try:
        cfg = load_config(config, overrides(seq_len, cp, cp_mode))
        dims = ParallelDims.from_config(cfg.parallel, cp)
        if cp > 1:
            dims.build_mesh("cpu")
        args = build_model_args(cfg.model)
        _, (model,) = build_model_parts(spec_of(args), cfg, dims, args, torch.device("cpu"))
        split = ContextParallelBatch(*dims.cp_coordinates()) if cp > 1 else None
        torch.manual_seed(0)
        inputs = torch.randint(0, args.vocab_size, (1, seq_len))
        labels = torch.randint(0, args.vocab_size, (1, seq_len))

        def step() -> None:
            x, y, weight = split.split(inputs, labels) if split else (inputs, labels, None)
            loss = model_loss(model, x, y, contextlib.nullcontext, cfg.training.loss_chunk_tokens)
            (loss * weight if weight is not None else loss).backward()

        step()
        peak = peak_of_step(step)
        peaks = [None] * cp
        dist.all_gather_object(peaks, peak)
        if rank == 0:
            out["peaks"] = peaks
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config: str, seq_len: int, cp: int, cp_mode: str) -> list[int]:
    """Every rank's measured peak of one case (cp processes)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(cp, _free_port(), config, seq_len, cp_mode, out), nprocs=cp, join=True)
        return list(out["peaks"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "debug.toml"))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cp-mode", default="ring", choices=["ring", "ulysses"])
    a = p.parse_args(argv)
    print(f"{Path(a.config).name}, seq {a.seq_len}, one sequence per step, cp_mode {a.cp_mode}; per rank, the "
          "step's peak above parameters and gradients (CPU allocator accounting)")
    print(f"{'cp':>3}  {'measured MiB':>12}  {'planned MiB':>11}  {'planned/measured':>16}")
    for cp in a.cp:
        measured = max(measure(a.config, a.seq_len, cp, a.cp_mode))
        planned = planned_bytes(a.config, a.seq_len, cp, a.cp_mode)
        print(f"{cp:>3}  {measured / 2**20:>12.1f}  {planned / 2**20:>11.1f}  {planned / measured:>16.3f}")


if __name__ == "__main__":
    main()

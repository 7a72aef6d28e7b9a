"""`titan-npu bench`: train a fixed number of steps through the real Trainer and report speed and memory.

    titan-npu bench --config configs/debug.toml --steps 20 --warmup 3 [--json] [--section.key value ...]
    torchrun --nproc_per_node 8 -m titan_npu.cli bench --config configs/llama3_8b.toml --data_dir /data/tokens

The run is the configured run without its side effects: no checkpoint is resumed or written, no end-of-run
report, and metrics go to a temporary directory unless --metrics.log_dir (or --log_dir) is given. Everything
else -- data loader, metrics logging, parallel layout, kernels, precision, compile -- is the configured path, so
the figures are the ones training gets. The first --warmup steps (allocator, kernel selection, compilation) are
not counted. Each measured step ends with a device synchronisation, so its time is the device's time.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from titan_npu.errors import ConfigError

log = logging.getLogger("titan_npu")

GB = 1024**3


class StepTimer:
    """A Trainer step callback: synchronises the device after every step and keeps the clock readings."""

    def __init__(self, synchronize, clock=time.perf_counter) -> None:
        self._synchronize = synchronize
        self._clock = clock
        self.start_time: float | None = None
        self.ends: list[float] = []

    def start(self) -> None:
        """Take the reading that the first step's time is counted from."""
        self._synchronize()
        self.start_time = self._clock()

    def __call__(self, step: int) -> None:
        self._synchronize()
        self.ends.append(self._clock())

    def durations(self) -> list[float]:
        """Seconds of each step, in order (the first one counted from start())."""
        if self.start_time is None:
            raise RuntimeError("StepTimer.start() was not called")
        marks = [self.start_time, *self.ends]
        return [b - a for a, b in zip(marks, marks[1:])]


@dataclass(frozen=True)
class StepTimes:
    """Distribution of the measured step times, in seconds."""

    median: float
    mean: float
    min: float
    max: float
    p10: float
    p90: float
    spread: float  # (p90 - p10) / median: the relative width of the middle 80%


def step_time_stats(durations: list[float]) -> StepTimes:
    """Median, mean, extremes and the 10-90% spread of step times."""
    if not durations:
        raise ValueError("no measured steps")
    ordered = sorted(durations)
    median = statistics.median(ordered)
    p10, p90 = _quantile(ordered, 0.1), _quantile(ordered, 0.9)
    return StepTimes(median, statistics.fmean(ordered), ordered[0], ordered[-1], p10, p90,
                     (p90 - p10) / median if median > 0 else 0.0)


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class BenchResult:
    """What `titan-npu bench` reports (the --json object)."""

    device: str
    device_name: str
    world_size: int
    torch_version: str
    params: int
    dtype: str
    mixed_precision: bool
    steps: int
    warmup: int
    tokens_per_step: int  # global, all devices
    tokens_per_s: float  # global: measured tokens / measured seconds
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float  # 0..1 of peak_tflops
    peak_tflops: float  # per device, of the compute dtype (measured matmul peak on cpu)
    step_time: StepTimes
    peak_memory_gb: float  # max over ranks: peak RSS on cpu, peak allocated on accelerators
    peak_reserved_gb: float  # accelerators: the allocator's peak reservation (= peak_memory_gb on cpu)
    loss_first: float  # logged loss of step 1 (rank 0 only; nan elsewhere)
    loss_last: float  # logged loss of the last step
    seq_len: int = 0
    batch_size: int = 0  # sequences per device per micro-step
    compiled: bool = False  # compile.enable
    attention: str = ""  # the attention kernel: the op backend, and on CUDA the SDPA kernel that runs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    durations: list[float],
    warmup: int,
    tokens_per_step: int,
    world_size: int,
    flops_per_token: float,
    peak_flops: float,
) -> tuple[StepTimes, float, float, float]:
    """Step-time stats and (global tokens/s, TFLOP/s per device, MFU) of the steps after the warm-up."""
    measured = durations[warmup:]
    if not measured:
        raise ValueError(f"{len(durations)} steps ran, none after the {warmup} warm-up steps")
    seconds = sum(measured)
    tokens_per_s = tokens_per_step * len(measured) / seconds
    achieved = tokens_per_s / world_size * flops_per_token
    return step_time_stats(measured), tokens_per_s, achieved / 1e12, achieved / peak_flops if peak_flops else 0.0


def peak_memory(device) -> tuple[float, float]:
    """(peak in use, peak reserved) in GB since the last reset: process peak RSS on cpu."""
    from titan_npu.device import device_module, memory_stats

    mod = device_module(device.type)
    if mod is None:
        peak = memory_stats(device).peak_gb
        return peak, peak
    return mod.max_memory_allocated(device.index) / GB, mod.max_memory_reserved(device.index) / GB


def _max_over_ranks(values: list[float], device) -> list[float]:
    """Element-wise max of `values` over all ranks (a collective when a process group is up)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    where = torch.device("cpu") if dist.get_backend() == "gloo" else device.torch_device
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def logged_losses(log_dir: str) -> list[float]:
    """The losses of the steps logged to <log_dir>/metrics.jsonl, in order ([nan] when none)."""
    path = os.path.join(log_dir, "metrics.jsonl")
    losses = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if "loss" in record and "step" in record and "tokens_per_s" in record:
                    losses.append(float(record["loss"]))
    return losses or [float("nan")]


def prepare_config(cfg, steps: int, warmup: int, log_dir: str) -> None:
    """Turn the user's config into the benchmark's: warmup + steps steps, no checkpoints, no report."""
    cfg.training.max_steps = warmup + steps
    cfg.checkpoint.enable = False
    cfg.checkpoint.initial_load = ""
    cfg.metrics.report = False
    cfg.metrics.log_dir = log_dir
    cfg.validation.enable = False
    cfg.profiling.enable = False


def run_bench(cfg, steps: int, warmup: int) -> BenchResult:
    """Build the Trainer for cfg, train warmup + steps steps, and measure the last `steps`."""
    from titan_npu.device import synchronize
    from titan_npu.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        timer = StepTimer(lambda: synchronize(trainer.device))
        trainer.step_callbacks.append(timer)
        timer.start()
        trainer.train()
        durations = timer.durations()
        if len(durations) < warmup + steps:
            raise ConfigError(
                f"bench: the run stopped after {len(durations)} of {warmup + steps} steps "
                f"(a signal or the non-finite guard); see the log above"
            )
        t = cfg.training
        times, tokens_per_s, tflops, mfu = summarize(
            durations, warmup, trainer.tokens_per_step, trainer.world_size, trainer.flops_per_token,
            trainer.peak_flops)
        used, reserved = _max_over_ranks(list(peak_memory(trainer.device)), trainer.device)
        losses = logged_losses(cfg.metrics.log_dir) if trainer.rank == 0 else [float("nan")]
        return BenchResult(
            device=trainer.device.type,
            device_name=trainer.device.name,
            world_size=trainer.world_size,
            torch_version=torch.__version__,
            params=trainer.model_args.num_params(),
            dtype=t.dtype,
            mixed_precision=bool(t.mixed_precision),
            steps=steps,
            warmup=warmup,
            tokens_per_step=trainer.tokens_per_step,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_device=tokens_per_s / trainer.world_size,
            tflops_per_device=tflops,
            mfu=mfu,
            peak_tflops=trainer.peak_flops / 1e12,
            step_time=times,
            peak_memory_gb=used,
            peak_reserved_gb=reserved,
            loss_first=losses[0],
            loss_last=losses[-1],
            seq_len=t.seq_len,
            batch_size=t.batch_size,
            compiled=bool(cfg.compile.enable),
            attention=attention_kernel(trainer),
        )
    finally:
        trainer.close()


def attention_kernel(trainer) -> str:
    """What runs attention: the op backend ("cuda", "npu", "cpu", "reference"), with the SDPA kernel on CUDA."""
    from titan_npu.ops import current_kernels

    if not trainer.model_args.use_flash_attention:
        return "eager (use_flash_attention = false)"
    backend = current_kernels(trainer.device.type)["attention"]
    return f"{backend}: {trainer.attention_kernel}" if trainer.attention_kernel else backend


def format_result(r: BenchResult) -> str:
    """The human-readable report."""
    st = r.step_time
    precision = r.dtype if r.dtype == "fp32" else f"{r.dtype} {'mixed' if r.mixed_precision else 'pure'}"
    lines = [
        f"bench: {r.params / 1e6:.2f}M params, {precision}, {r.world_size} x {r.device} ({r.device_name}), "
        f"torch {r.torch_version}",
        f"  steps           {r.steps} measured after {r.warmup} warm-up, {r.tokens_per_step} tokens/step",
        f"  throughput      {r.tokens_per_s:,.0f} tokens/s global, {r.tokens_per_s_per_device:,.0f} per device",
        f"  mfu             {r.mfu * 100:.1f}% ({r.tflops_per_device:.3g} of {r.peak_tflops:.3g} TFLOP/s per device)",
        f"  step time       median {st.median * 1e3:.1f} ms, mean {st.mean * 1e3:.1f}, min {st.min * 1e3:.1f}, "
        f"max {st.max * 1e3:.1f}, p10-p90 spread {st.spread * 100:.1f}%",
    ]
    if r.device == "cpu":
        lines.append(f"  peak memory     {r.peak_memory_gb:.2f} GB (process peak RSS)")
    else:
        lines.append(f"  peak memory     {r.peak_memory_gb:.2f} GB allocated, {r.peak_reserved_gb:.2f} GB reserved "
                     f"(max over ranks)")
    lines.append(f"  attention       {r.attention}{', compiled' if r.compiled else ''}")
    lines.append(f"  loss            {r.loss_first:.4f} -> {r.loss_last:.4f}")
    return "\n".join(lines)

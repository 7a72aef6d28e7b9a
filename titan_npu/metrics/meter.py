"""What happened between two log steps: steps, tokens, wall-clock, data time and the per-step losses.

The meter never synchronises the device: it keeps the per-step losses as device tensors and reads the clock only
when the trainer asks for a window, right after the one synchronisation of a log step. Windows are contiguous
(each starts at the clock reading that ended the previous one), so logging itself is counted and the throughput
agrees with tokens / wall-clock measured from outside; time spent in `excluded()` (validation, checkpoint saves)
is taken out.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_npu.metrics.throughput import Throughput, throughput


@dataclass
class Window:
    """The steps since the previous log step."""

    first_step: int  # first training step in the window
    steps: int
    seconds: float  # wall-clock of the window, excluded time removed
    data_seconds: float  # of which waiting for the data loader
    losses: list[float] = field(default_factory=list)  # this rank's loss of each step, in order


class StepMeter:
    """Counts steps and data time, keeps per-step losses on the device, and cuts windows at log steps."""

    def __init__(
        self,
        tokens_per_step: int,
        world_size: int,
        flops_per_token: float,
        peak_flops: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._clock = clock
        self._start: float | None = None
        self._excluded = 0.0
        self._reset(first_step=1)

    def _reset(self, first_step: int) -> None:
        self._first_step = first_step
        self._steps = 0
        self._data = 0.0
        self._losses: list[torch.Tensor | float] = []

    def start(self, next_step: int = 1) -> None:
        """Start the clock; `next_step` is the number of the first step to be counted."""
        self._reset(next_step)
        self._excluded = 0.0
        self._start = self._clock()

    def step(self, loss: torch.Tensor | float, data_seconds: float) -> None:
        """Record one finished optimizer step (no device synchronisation)."""
        self._steps += 1
        self._data += data_seconds
        self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside (validation, checkpoints) is not counted as training time."""
        t0 = self._clock()
        try:
            yield
        finally:
            self._excluded += self._clock() - t0

    def window(self) -> Window:
        """Close the current window (call after synchronising the device) and start the next one at the same time."""
        if self._start is None:
            raise RuntimeError("StepMeter.start() was not called")
        now = self._clock()
        seconds = max(now - self._start - self._excluded, 0.0)
        w = Window(self._first_step, self._steps, seconds, self._data, _to_floats(self._losses))
        self._start, self._excluded = now, 0.0
        self._reset(self._first_step + self._steps)
        return w

    def throughput(self, w: Window) -> Throughput:
        """Tokens/s, TFLOPs and MFU of a window."""
        return throughput(self.tokens_per_step * w.steps, w.seconds, self.world_size, self.flops_per_token,
                          self.peak_flops)


def _to_floats(values: list[torch.Tensor | float]) -> list[float]:
    """Per-step losses to Python floats with one device-to-host copy."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    if len(tensors) == len(values):
        return torch.stack([t.float().reshape(()) for t in tensors]).tolist()
    return [float(v) for v in values]


def step_record(
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    tp: Throughput,
    w: Window,
    mem: Any,
    tokens_seen: int,
) -> dict[str, Any]:
    """One metrics.jsonl object (and step line) in the order of DESIGN.md; `mem` is a device.MemoryStats."""
    steps = max(w.steps, 1)
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tp.tokens_per_s,
        "tokens_per_s_per_device": tp.tokens_per_s_per_device,
        "tflops_per_device": tp.tflops_per_device,
        "mfu": tp.mfu,
        "mem_used_gb": mem.used_gb,
        "mem_peak_gb": mem.peak_gb,
        "mem_total_gb": mem.total_gb,
        "step_time_s": w.seconds / steps,
        "data_time_s": w.data_seconds / steps,
        "tokens_seen": tokens_seen,
        "window_steps": w.steps,
    }


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf

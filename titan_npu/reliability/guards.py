"""The numerics guard: which steps' updates are skipped (non-finite loss or grad_norm, optional loss spikes).

Every rank decides from the same gathered numbers (each rank's loss, the global grad_norm), so a NaN on one rank
makes all ranks skip together and the replicas stay identical. Without the spike policy the device has already
skipped the update by the same rule (run.py); the guard then only counts, logs and decides when the run stops.
A skipped step still counts as a step: its data is consumed and the learning-rate schedule advances, only the
weights and optimizer state stay as they were.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from dataclasses import dataclass

from titan_npu.errors import TitanError

log = logging.getLogger("titan_npu")

MIN_SPIKE_HISTORY = 20  # losses known before the spike policy may skip anything


class TrainingHalted(TitanError):
    """Training stopped on purpose (too many skipped updates); the message says what was saved and what to do."""


@dataclass(frozen=True)
class Verdict:
    """The decision for one step: apply the update or not, and why not."""

    apply: bool
    reason: str = ""


class StepGuard:
    """Skips updates of steps with non-finite numbers (and loss spikes when spike_sigma > 0); counts them.

    With a loss scaler (fp16) a non-finite grad_norm is the scaler's business: it skips that update and lowers the
    scale itself, so only a non-finite loss counts here.
    """

    def __init__(self, skip_nonfinite: bool = True, max_skipped_steps: int = 10, spike_sigma: float = 0.0,
                 spike_window: int = 100, scaler_handles_overflow: bool = False, verbose: bool = True) -> None:
        self.verbose = verbose  # log each skip (rank 0 only, the verdict is the same everywhere)
        self.skip_nonfinite = skip_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.spike_sigma = spike_sigma
        self.scaler_handles_overflow = scaler_handles_overflow
        self.window: deque[float] = deque(maxlen=max(spike_window, 2))
        self.consecutive = 0
        self.total = 0
        self.last_applied_step = 0
        self.first_skipped_step = 0  # first step of the current run of skips
        self.halt_message = ""

    @property
    def active(self) -> bool:
        """True when the steps' numbers are checked (on the device, or on the host for the spike policy)."""
        return self.skip_nonfinite or self.spike_sigma > 0

    def decide(self, step: int, losses: list[float], grad_norm: float) -> Verdict:
        """The verdict for `step` from every rank's loss and the global grad_norm (identical on every rank)."""
        verdict = self._judge(losses, grad_norm)
        if verdict.apply:
            self.consecutive = 0
            self.last_applied_step = step
            return verdict
        if self.consecutive == 0:
            self.first_skipped_step = step
        self.consecutive += 1
        self.total += 1
        if self.verbose:
            log.warning("step %d: update skipped (%s); %d in a row (the run stops at %d), %d skipped in total",
                        step, verdict.reason, self.consecutive, self.max_skipped_steps, self.total)
        if self.consecutive >= self.max_skipped_steps:
            self.halt_message = (
                f"steps {self.first_skipped_step}-{step}: {self.consecutive} updates in a row were skipped "
                f"(last: {verdict.reason}; reliability.max_skipped_steps={self.max_skipped_steps})"
            )
            self.consecutive = 0  # before this step's checkpoint: a relaunch gets a fresh budget of skips
        return verdict

    def _judge(self, losses: list[float], grad_norm: float) -> Verdict:
        if self.skip_nonfinite:
            bad = [rank for rank, loss in enumerate(losses) if not math.isfinite(loss)]
            if bad:
                where = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {', '.join(map(str, bad[:4]))}"
                more = "..." if len(bad) > 4 else ""
                return Verdict(False, f"non-finite loss on {where}{more}")
            if not math.isfinite(grad_norm) and not self.scaler_handles_overflow:
                return Verdict(False, f"non-finite grad_norm={grad_norm}")
        if self.spike_sigma > 0:
            finite = [loss for loss in losses if math.isfinite(loss)]
            if finite:
                loss = sum(finite) / len(finite)
                z = self._zscore(loss)
                self.window.append(loss)  # spikes join the window, so a lasting shift becomes the new normal
                if z is not None and z > self.spike_sigma:
                    return Verdict(False, f"loss spike {loss:.4f}, {z:.1f} std devs above the recent mean")
        return Verdict(True)

    def _zscore(self, loss: float) -> float | None:
        n = len(self.window)
        if n < min(MIN_SPIKE_HISTORY, self.window.maxlen):
            return None
        mean = sum(self.window) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / (n - 1))
        # A nearly flat curve must not turn noise into spikes: the spread is floored at 0.5% of the mean.
        return (loss - mean) / max(std, 0.005 * abs(mean), 1e-12)

    def state_dict(self) -> dict[str, str]:
        """Counters and the spike window, as one JSON string (a checkpoint stores it as plain bytes)."""
        return {"guard": json.dumps({
            "consecutive": self.consecutive, "total": self.total, "last_applied_step": self.last_applied_step,
            "first_skipped_step": self.first_skipped_step, "window": list(self.window),
        })}

    def load_state_dict(self, state: dict[str, str]) -> None:
        data = json.loads(state["guard"])
        self.consecutive = int(data["consecutive"])
        self.total = int(data["total"])
        self.last_applied_step = int(data["last_applied_step"])
        self.first_skipped_step = int(data["first_skipped_step"])
        self.window.clear()
        self.window.extend(float(x) for x in data["window"])

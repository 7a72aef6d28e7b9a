"""Loss spikes and non-finite values, turned into the short flags the step line shows in brackets."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from titan_npu.errors import ConfigError


class SpikeDetector:
    """Flags a step whose loss exceeds the mean of the recent window by more than `sigma` standard deviations.

    The window holds the last `window` finite per-step losses (spikes included, so a lasting jump stops being
    flagged once it is the new normal). No flag is raised before `min_history` losses are known. The standard
    deviation is floored at `rel_floor` x |mean| so that a nearly flat curve does not flag noise.
    """

    def __init__(self, sigma: float = 4.0, window: int = 100, min_history: int = 20, rel_floor: float = 0.005) -> None:
        if not sigma > 0:
            raise ConfigError(f"metrics.spike_sigma={sigma} must be > 0 (e.g. 4.0)")
        if window < 2:
            raise ConfigError(f"metrics.spike_window={window} must be >= 2 steps (e.g. 100)")
        self.sigma = sigma
        self.min_history = min(min_history, window)
        self.rel_floor = rel_floor
        self._history: deque[float] = deque(maxlen=window)

    def zscore(self, loss: float) -> float | None:
        """How many (floored) standard deviations `loss` is above the window mean; None while history is short."""
        n = len(self._history)
        if n < self.min_history:
            return None
        mean = sum(self._history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self._history) / (n - 1))
        std = max(std, self.rel_floor * abs(mean), 1e-12)
        return (loss - mean) / std

    def update(self, first_step: int, losses: Sequence[float]) -> list[tuple[int, float]]:
        """Feed consecutive per-step losses starting at `first_step`; returns (step, z) of each spike among them."""
        spikes = []
        for i, loss in enumerate(losses):
            if not math.isfinite(loss):
                continue
            z = self.zscore(loss)
            if z is not None and z > self.sigma:
                spikes.append((first_step + i, z))
            self._history.append(loss)
        return spikes


def _steps_text(steps: Sequence[int], limit: int = 3) -> str:
    shown = ",".join(str(s) for s in steps[:limit])
    return shown + (f",... ({len(steps)} steps)" if len(steps) > limit else "")


def health_flags(
    first_step: int,
    losses: Sequence[float],
    grad_norm: float,
    detector: SpikeDetector | None,
) -> list[str]:
    """Flags for one log window: non-finite losses, a non-finite grad_norm, loss spikes (largest first)."""
    flags = []
    bad = [first_step + i for i, x in enumerate(losses) if not math.isfinite(x)]
    if bad:
        flags.append(f"nonfinite_loss step={_steps_text(bad)}")
    if not math.isfinite(grad_norm):
        flags.append(f"nonfinite_grad_norm {grad_norm}")
    if detector is not None:
        spikes = sorted(detector.update(first_step, losses), key=lambda s: -s[1])
        if spikes:
            step, z = spikes[0]
            more = f" (+{len(spikes) - 1} more)" if len(spikes) > 1 else ""
            flags.append(f"loss_spike step={step} z={z:.1f}{more}")
    return flags

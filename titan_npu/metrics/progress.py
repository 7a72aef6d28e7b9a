"""Rank 0's progress display: a one-line bar with ETA on a terminal, the plain step lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

from titan_npu.errors import ConfigError

STYLES = ("auto", "bar", "lines")


def resolve_style(style: str, stream: TextIO | None = None) -> str:
    """'bar' or 'lines': auto picks the bar only when `stream` (default stderr) is a terminal."""
    if style not in STYLES:
        raise ConfigError(f"metrics.progress={style!r} is not a progress style (choose auto, bar or lines)")
    if style != "auto":
        return style
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):
        return "lines"


def format_duration(seconds: float) -> str:
    """Compact h/m/s: 3725 -> '1h02m', 252 -> '4m12s', 9.4 -> '9s'."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(max(seconds, 0.0)))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class EtaEstimator:
    """Seconds left, from the step rate over the last `window` updates (the first, warm-up step is never used)."""

    def __init__(self, total_steps: int, window: int = 50, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps = total_steps
        self._clock = clock
        self._points: deque[tuple[int, float]] = deque(maxlen=window)

    def update(self, step: int) -> None:
        """Note that `step` has just finished."""
        self._points.append((step, self._clock()))

    def seconds_per_step(self) -> float | None:
        if len(self._points) < 2:
            return None
        (s0, t0), (s1, t1) = self._points[0], self._points[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def eta_seconds(self) -> float | None:
        """Estimated seconds until total_steps, None until two steps are known."""
        per_step = self.seconds_per_step()
        if per_step is None:
            return None
        return per_step * max(self.total_steps - self._points[-1][0], 0)


class ProgressBar:
    """`step 120/1000 [###------] 12% 3.1 s/it eta 45m10s loss 3.2140` redrawn in place on a terminal.

    While the bar is shown, every record of the `titan_npu` logger first erases it (so log lines never mix with
    it); the next update draws it again.
    """

    def __init__(self, eta: EtaEstimator, stream: TextIO | None = None, width: int = 24, min_interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps = max(eta.total_steps, 1)
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.min_interval_s = min_interval_s
        self._clock = clock
        self.eta = eta
        self._last_draw = -float("inf")
        self._shown = False
        self._loss: float | None = None
        self._step = 0
        self._filter = _EraseBeforeLog(self)
        for handler in logging.getLogger("titan_npu").handlers:
            handler.addFilter(self._filter)

    def update(self, step: int, loss: float | None = None) -> None:
        """A step finished (no device sync: `loss` is the last logged one); redraws at most every min_interval_s."""
        self._step = step
        if loss is not None:
            self._loss = loss
        now = self._clock()
        if now - self._last_draw >= self.min_interval_s or step >= self.total_steps:
            self._draw()
            self._last_draw = now

    def render(self) -> str:
        """The bar's text for the current state."""
        frac = min(self._step / self.total_steps, 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        parts = [f"step {self._step}/{self.total_steps} [{bar}] {100 * frac:3.0f}%"]
        per_step = self.eta.seconds_per_step()
        if per_step:
            parts.append(f"{per_step:.3g} s/it")
        eta = self.eta.eta_seconds()
        parts.append(f"eta {format_duration(eta) if eta is not None else '?'}")
        if self._loss is not None:
            parts.append(f"loss {self._loss:.4f}")
        return " ".join(parts)

    def _draw(self) -> None:
        self.stream.write("\r\x1b[K" + self.render())
        self.stream.flush()
        self._shown = True

    def erase(self) -> None:
        """Remove the bar from the terminal line (it comes back on the next update)."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False
            self._last_draw = -float("inf")

    def close(self) -> None:
        """Leave the final bar on its own line and stop intercepting log records."""
        for handler in logging.getLogger("titan_npu").handlers:
            handler.removeFilter(self._filter)
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


class _EraseBeforeLog(logging.Filter):
    """A handler filter that clears the bar before the handler writes its record."""

    def __init__(self, bar: ProgressBar) -> None:
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.erase()
        return True


class Progress:
    """Rank 0's view of how far the run is: the ETA always, the bar only in 'bar' style; inert on other ranks."""

    def __init__(self, style: str, total_steps: int, enabled: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.style = resolve_style(style, stream)
        self.eta = EtaEstimator(total_steps, clock=clock)
        self.bar = ProgressBar(self.eta, stream, clock=clock) if enabled and self.style == "bar" else None
        self._first: int | None = None

    def update(self, step: int, loss: float | None = None) -> None:
        """Call after every step; cheap (no device work)."""
        if self._first is None:
            self._first = step
        elif step > self._first:  # the first step of a (resumed) run carries start-up costs: keep it out of the ETA
            self.eta.update(step)
        if self.bar is not None:
            self.bar.update(step, loss)

    def eta_seconds(self) -> float | None:
        """Seconds to the last step, None until known."""
        return self.eta.eta_seconds()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

"""Progress of a long data job: a bar on a terminal, a plain line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """Reports documents, tokens and bytes done against a byte total, with docs/s and tokens/s."""

    def __init__(self, total_bytes: int, stream: TextIO | None = None, bar: bool | None = None,
                 line_interval_s: float = 5.0):
        self.total_bytes = max(total_bytes, 1)
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty() if bar is None else bar
        self.interval = 0.1 if self.bar else line_interval_s
        self.start = time.monotonic()
        self._last = self.start
        self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, bytes_done: int) -> None:
        """Add docs and tokens; bytes_done is the running total of input bytes consumed."""
        self.docs += docs
        self.tokens += tokens
        self.bytes = bytes_done
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._emit(final=False)

    def close(self) -> None:
        self._emit(final=True)

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.start

    def rates(self) -> tuple[float, float, float]:
        """(docs/s, tokens/s, MB/s) since the start."""
        dt = max(time.monotonic() - self.start, 1e-9)
        return self.docs / dt, self.tokens / dt, self.bytes / dt / 1e6

    def _emit(self, final: bool) -> None:
        docs_s, tokens_s, _ = self.rates()
        frac = 1.0 if final else min(self.bytes / self.total_bytes, 1.0)
        stats = f"{_si(self.docs)} docs, {_si(self.tokens)} tokens, {_si(docs_s)} docs/s, {_si(tokens_s)} tokens/s"
        if self.bar:
            filled = int(frac * 30)
            end = "\n" if final else ""
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%} {stats}{end}")
        else:
            self.stream.write(f"{frac:4.0%} {stats}\n")
        self.stream.flush()

"""SIGTERM / SIGINT as a request to checkpoint at the next step boundary; a second signal ends the process at once.

Python runs signal handlers only in the main thread and only between bytecodes, so a main thread blocked in a
collective would not see a second signal until the collective returns. The handler here therefore also routes
signals through a wakeup pipe that a small thread reads: it records the first signal and, on a later one, ends the
process itself, whatever the main thread is doing.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable

log = logging.getLogger("titan_npu")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Launchers forward the signal they get (torchrun) and schedulers may signal every process of a job as well
# (SLURM): copies arriving within this window are one request, not a second one.
DUPLICATE_WINDOW_S = 1.0


class PreemptionHandler:
    """Records the first SIGTERM/SIGINT (`signum`); a second one, later than the duplicate window, exits at once."""

    def __init__(self, duplicate_window_s: float = DUPLICATE_WINDOW_S) -> None:
        self.signum = 0
        self.duplicate_window_s = duplicate_window_s
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self.loop_running: Callable[[], bool] | None = None  # False once the training loop is gone

    @property
    def installed(self) -> bool:
        return self._pipe is not None

    def install(self) -> bool:
        """Take over SIGTERM and SIGINT (main thread only); False, and nothing changed, when called elsewhere."""
        if threading.current_thread() is not threading.main_thread() or self.installed:
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the interpreter's C-level handler must never block on it
        self._pipe = (read_fd, write_fd)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, _ignore_in_main_thread)
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="titan-signals", daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        """Give the signals back to the handlers that had them before install()."""
        if not self.installed:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        read_fd, write_fd = self._pipe
        self._pipe = None
        os.close(write_fd)  # wakes the watcher with end-of-file
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        os.close(read_fd)

    def _watch(self, read_fd: int) -> None:
        while True:
            select.select([read_fd], [], [])
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._received(signum)

    def _received(self, signum: int) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.loop_running is not None and not self.loop_running():
            # The training loop ended without uninstall(): nobody will checkpoint, so act like the default handler.
            os.write(2, f"received {name} after training ended: exiting\n".encode())
            os._exit(128 + signum)
        if not self.signum:
            self._first_at = now
            self.signum = signum
            log.warning("received %s: finishing the current step, then saving a checkpoint (send it again to exit "
                         "at once)", name)
            return
        if now - self._first_at < self.duplicate_window_s:
            return
        os.write(2, f"received {name} again: exiting at once without a checkpoint\n".encode())
        os._exit(128 + signum)


def _ignore_in_main_thread(signum: int, frame: object) -> None:
    """The Python-level handler: the watcher thread does the work (it sees the signal even when this cannot run)."""

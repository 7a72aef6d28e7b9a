"""SIGTERM / SIGINT as a request to checkpoint at the next step boundary; a second signal ends the process at once.

Python runs signal handlers only in the main thread and only between bytecodes, so a main thread blocked in a
collective would not see a second signal until the collective returns. The handler here therefore also routes
signals through a wakeup pipe that a small thread reads: it records the first signal and, on a later one, ends the
process itself, whatever the main thread is doing.

Handlers and the wakeup pipe are state of this process only. A forked child (a data-loader worker, a pool process)
would otherwise inherit both: a signal sent to the child would be written into this process's pipe and read as a
preemption of the trainer, and the child's copy of the pipe would keep the watcher from ever seeing it closed. A
child therefore gets the handlers back that the process had before install() and closes its copy of the pipe.
"""

from __future__ import annotations

import contextlib
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
_STOP = b"\0"  # written by uninstall() to end the watcher; no signal has the number 0

_installed: PreemptionHandler | None = None  # the handler a forked child must undo
_mask_before_fork: set[signal.Signals] | None = None  # the forking thread's signal mask, while SIGNALS are blocked


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
        global _installed
        _installed = self
        self._thread = threading.Thread(target=self._watch, args=(read_fd,), name="titan-signals", daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        """Give the signals back to the handlers that had them before install()."""
        if not self.installed:
            return
        self._restore_handlers()
        read_fd, write_fd = self._pipe
        self._pipe = None
        with contextlib.suppress(BlockingIOError):  # a full pipe: the watcher drains it and then reads end-of-file
            os.write(write_fd, _STOP)
        os.close(write_fd)
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        # read_fd is closed by the watcher itself: closed here, its number could be reused (by a checkpoint file, a
        # socket) while the watcher still reads it, and that file's bytes would be taken for signals.

    def _restore_handlers(self) -> None:
        global _installed
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        if _installed is self:
            _installed = None

    def _after_fork_in_child(self) -> None:
        """In a forked child: the handlers and wakeup fd the process had before install(), no copy of the pipe."""
        self._restore_handlers()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None
        self._thread = None  # threads do not survive a fork

    def _watch(self, read_fd: int) -> None:
        try:
            while True:
                select.select([read_fd], [], [])
                data = os.read(read_fd, 64)
                if not data:
                    return
                for signum in data:
                    if signum == _STOP[0]:
                        return
                    if signum in SIGNALS:
                        self._received(signum)
        finally:
            os.close(read_fd)

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


def leave_signals_to_parent(worker_id: int = 0) -> None:
    """In a worker process (a DataLoader worker_init_fn): SIGINT and SIGTERM are its parent's to act on.

    Ctrl-C, torchrun and schedulers signal a whole process group; a loader worker that died of that would make the
    trainer's loader raise in the middle of the step it is about to checkpoint. SIGINT is ignored; SIGTERM ends the
    worker only when the parent sends it (the loader's and multiprocessing's own shutdown of the worker), and with
    exit status 0: the loader's SIGCHLD check raises in the parent for a worker that died of a signal.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the block
    threading.Thread(target=_end_on_sigterm_from, args=(parent,), name="titan-worker-signals", daemon=True).start()


def _end_on_sigterm_from(parent: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass
    os._exit(0)


def _before_fork() -> None:
    # Blocked across the fork, a signal sent to the new child waits until the child has its own handlers back,
    # instead of running the inherited ones (which write into this process's pipe).
    global _mask_before_fork
    if _installed is not None:
        _mask_before_fork = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def _restore_mask() -> None:
    global _mask_before_fork
    if _mask_before_fork is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _mask_before_fork)
        _mask_before_fork = None


def _after_fork_in_child() -> None:
    if _installed is not None:
        _installed._after_fork_in_child()
    _restore_mask()  # a signal that reached the child meanwhile is delivered now, to the child's own handlers


os.register_at_fork(before=_before_fork, after_in_parent=_restore_mask, after_in_child=_after_fork_in_child)

"""Hang detection: a step (or save) running past its limit dumps every thread's stack and the flight recorder, then
ends the process with HANG_EXIT_CODE so that torchrun restarts the job instead of it waiting for hours.

Two layers: a Python thread that writes the stacks and the collective trace to <log_dir>/watchdog/ and stderr, and
faulthandler's own C-level timer a little later, which dumps the stacks and exits even when a stuck call holds the
interpreter lock (a device synchronisation waiting on a hung collective can), where no Python thread can run.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

log = logging.getLogger("titan_npu")

HANG_EXIT_CODE = 124  # as timeout(1) reports a command that ran out of time
# faulthandler writes to a file descriptor; sys.stderr may be an object without one (captured, redirected).
STDERR_FD = 2
MIN_STEP_SAMPLES = 10  # step times known before watchdog_step_factor applies
STEP_FACTOR_FLOOR_S = 60.0  # a factor-based limit never goes below this (or the base limit, if lower)

# Flight-recorder buffer sizes by the variable each backend reads at process-group creation. torch_npu also reads
# TORCH_HCCL_TRACE_BUFFER_SIZE at import (_init/core/optional_features.py, to preload torch._inductor for the dump's
# symbols), so on npu it is set before torch is imported (titan_npu/train.py).
_RECORDER_ENV = {
    "cpu": ("TORCH_FR_BUFFER_SIZE",),
    "cuda": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    "npu": ("TORCH_FR_BUFFER_SIZE", "TORCH_HCCL_TRACE_BUFFER_SIZE"),
}
# ProcessGroupHCCL dumps the recorder on a watchdog timeout with TORCH_HCCL_DUMP_ON_TIMEOUT=1, which "must be set
# together with TORCH_HCCL_ENABLE_MONITORING=1 and TORCH_HCCL_TRACE_BUFFER_SIZE > 0" (ProcessGroupHCCL.hpp:75-78):
# it comes with the buffer, and the monitor with the NPU launch environment (device/env.py).
_DUMP_ENV = {"npu": {"TORCH_HCCL_DUMP_ON_TIMEOUT": "1"}}


def flight_recorder_env(entries: int, device_type: str) -> dict[str, str]:
    """The variables that keep the last `entries` collectives of the backend for the hang dump ({} for 0)."""
    if entries <= 0:
        return {}
    env = dict.fromkeys(_RECORDER_ENV.get(device_type, ("TORCH_FR_BUFFER_SIZE",)), str(entries))
    env.update(_DUMP_ENV.get(device_type, {}))
    return env


def enable_flight_recorder(entries: int, device_type: str) -> list[str]:
    """Ask the collective backends to keep the last `entries` collectives (before the process group exists; on
    npu before torch is imported).

    Values already in the environment win; returns the variables set here.
    """
    set_here = {k: v for k, v in flight_recorder_env(entries, device_type).items() if k not in os.environ}
    os.environ.update(set_here)
    return list(set_here)


def flight_recorder_json(device_type: str) -> bytes | None:
    """This process's flight-recorder trace as JSON (None when the backend keeps none or no process group exists)."""
    dist = sys.modules.get("torch.distributed")  # never import torch from a firing watchdog: it may take seconds
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    dumpers = []
    if device_type == "npu":
        try:
            import torch_npu

            dumpers.append(getattr(torch_npu._C._distributed_c10d, "_dump_hccl_trace_json", None))
        except (ImportError, AttributeError):
            pass
    try:
        import torch._C._distributed_c10d as c10d

        dumpers += [getattr(c10d, "_dump_fr_trace_json", None), getattr(c10d, "_dump_nccl_trace_json", None)]
    except ImportError:
        pass
    for dump in dumpers:
        if dump is None:
            continue
        try:
            return dump(includeCollectives=True, onlyActive=False)
        except Exception:  # a backend without a recorder raises; try the next
            continue
    return None


def step_limit(base_s: float, factor: float, step_times: Collection[float]) -> float:
    """The limit of one training step: base_s, or factor x the median step time once enough steps are known."""
    if factor <= 0 or len(step_times) < MIN_STEP_SAMPLES:
        return base_s
    return min(base_s, max(factor * statistics.median(step_times), min(base_s, STEP_FACTOR_FLOOR_S)))


class Watchdog:
    """Fires when the phase begun by the last beat() outlasts its limit; `fire` is replaceable for tests."""

    def __init__(self, limit_s: float, step_factor: float = 0.0, dump_dir: str | Path = "logs", rank: int = 0,
                 device_type: str = "cpu", poll_s: float | None = None, backstop_s: float | None = None,
                 exit_delay_s: float | None = None) -> None:
        self.limit_s = float(limit_s)
        self.step_factor = step_factor
        self.dump_dir = Path(dump_dir)
        self.rank = rank
        self.device_type = device_type
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.limit_s / 10)
        # After its dump the firing thread waits this long before exiting, so that the peers can dump too.
        self.exit_delay_s = exit_delay_s if exit_delay_s is not None else min(10.0, max(3.0, 0.01 * self.limit_s))
        # The C-level timer waits this much longer, so the Python thread normally gets to dump the trace first.
        self.backstop_s = backstop_s if backstop_s is not None else min(60.0, max(self.exit_delay_s + 5,
                                                                                   0.1 * self.limit_s))
        self.step_times: deque[float] = deque(maxlen=50)
        self.loop_running: Callable[[], bool] | None = None  # False once the watched loop is gone
        self._label = ""
        self._began = 0.0
        self._limit = self.limit_s
        self._is_step = False
        self._armed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (the first beat() arms it)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="titan-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and cancel the C-level timer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self._armed = False
        faulthandler.cancel_dump_traceback_later()

    def beat(self, label: str, step: bool = True) -> None:
        """A new phase begins now: a training step (step=True) or something else (a save, a validation)."""
        now = time.monotonic()
        with self._lock:
            if self._armed and self._is_step:
                self.step_times.append(now - self._began)
            self._label, self._began, self._is_step, self._armed = label, now, step, True
            self._limit = step_limit(self.limit_s, self.step_factor, self.step_times) if step else self.limit_s

    def pause(self) -> None:
        """Nothing is timed until the next beat() (e.g. after the last step)."""
        with self._lock:
            self._armed = False
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        armed_for = None  # the beat the C-level timer was last armed for
        while not self._stop.wait(self.poll_s):
            with self._lock:
                now = time.monotonic()
                late = self._armed and now - self._began > self._limit
                label, limit, began = self._label, self._limit, self._began
                if self._armed and not late and armed_for != began:
                    # Armed from this thread, once per poll at most, so that a step costs the loop only beat().
                    faulthandler.dump_traceback_later(max(began + limit + self.backstop_s - now, 0.1), exit=True,
                                                      file=STDERR_FD)
                    armed_for = began
            if late:
                if self.loop_running is not None and not self.loop_running():
                    self.pause()  # the loop that armed it ended without stop(): nothing is hung
                    return
                self.fire(label, time.monotonic() - began, limit)
                return

    def fire(self, label: str, elapsed: float, limit: float) -> None:
        """Dump stacks and the flight recorder, give the other ranks a moment to do the same, exit."""
        header = (f"watchdog: rank {self.rank}: {label} has run {elapsed:.0f}s, over its limit of {limit:.0f}s "
                  f"(reliability.watchdog_timeout_s / comm.timeout_s); stacks follow, then exit {HANG_EXIT_CODE} "
                  "so the launcher can restart the job")
        # The C-level timer stays armed, later, in case writing the dump itself gets stuck on the hung state.
        faulthandler.dump_traceback_later(self.exit_delay_s + 30, exit=True, file=STDERR_FD)
        os.write(2, (header + "\n").encode())
        faulthandler.dump_traceback(file=STDERR_FD, all_threads=True)
        written = self._write_dump(header)
        if written:
            os.write(2, f"watchdog: rank {self.rank}: wrote {', '.join(written)}\n".encode())
        # The peers' watchdogs fire a little later (their step began later, their thread wakes later); exiting first
        # would break their collectives and turn their dumps into plain errors.
        time.sleep(self.exit_delay_s)
        os._exit(HANG_EXIT_CODE)

    def _write_dump(self, header: str) -> list[str]:
        written = []
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            stacks = self.dump_dir / f"rank-{self.rank}-stacks.txt"
            with open(stacks, "w") as f:
                f.write(header + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            written.append(str(stacks))
            trace = flight_recorder_json(self.device_type)
            if trace:
                recorder = self.dump_dir / f"rank-{self.rank}-flight-recorder.json"
                recorder.write_bytes(trace)
                written.append(f"{recorder} ({summarize_flight_recorder(trace)})")
        except OSError as e:  # a full or read-only disk must not stop the exit
            os.write(2, f"watchdog: rank {self.rank}: could not write the dump ({e})\n".encode())
        return written


def summarize_flight_recorder(trace: bytes) -> str:
    """One line about a flight-recorder dump: entries and the last collective with its state."""
    try:
        entries = json.loads(trace).get("entries") or []
    except (ValueError, AttributeError):
        return "not JSON"
    if not entries:
        return "no collectives recorded"
    last = entries[-1]
    return (f"{len(entries)} collectives recorded; last: {last.get('profiling_name')} seq "
            f"{last.get('collective_seq_id')} state {last.get('state')}")

"""The hang watchdog: limits, firing, the stack dump and exit code, and the C-level backstop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

from titan_npu.reliability.watchdog import (
    HANG_EXIT_CODE,
    MIN_STEP_SAMPLES,
    Watchdog,
    enable_flight_recorder,
    flight_recorder_env,
    step_limit,
)


def test_step_limit_is_the_base_until_enough_steps_are_known():
    assert step_limit(1800, 20, [1.0] * (MIN_STEP_SAMPLES - 1)) == 1800
    assert step_limit(1800, 0, [1.0] * 50) == 1800


def test_step_limit_follows_the_median_step_time_above_a_floor():
    assert step_limit(1800, 20, [10.0] * MIN_STEP_SAMPLES) == 200
    assert step_limit(1800, 20, [0.1] * MIN_STEP_SAMPLES) == 60  # fast steps: never below a minute
    assert step_limit(30, 20, [0.1] * MIN_STEP_SAMPLES) == 30  # nor above the base limit
    assert step_limit(1800, 20, [5.0] * 20 + [500.0] * 3) == 100  # the median ignores a few slow steps


class _Recording(Watchdog):
    """A watchdog whose fire() records instead of ending the process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fired = threading.Event()
        self.seen: tuple[str, float, float] | None = None

    def fire(self, label, elapsed, limit):
        self.seen = (label, elapsed, limit)
        self.fired.set()


def test_a_phase_that_outlasts_its_limit_fires_with_its_label():
    dog = _Recording(0.3, poll_s=0.02, backstop_s=60)
    dog.start()
    try:
        dog.beat("step 7")
        assert dog.fired.wait(5)
    finally:
        dog.stop()
    label, elapsed, limit = dog.seen
    assert label == "step 7" and limit == 0.3 and elapsed >= 0.3


def test_regular_beats_and_pauses_keep_it_quiet():
    dog = _Recording(0.4, poll_s=0.02, backstop_s=60)
    dog.start()
    try:
        for step in range(1, 8):
            dog.beat(f"step {step}")
            time.sleep(0.1)
        dog.pause()
        time.sleep(0.6)  # after the last step nothing is timed
        assert not dog.fired.is_set()
        assert len(dog.step_times) == 6
    finally:
        dog.stop()


def test_non_step_phases_do_not_count_as_step_times():
    dog = _Recording(10, poll_s=0.05, backstop_s=60)
    dog.beat("step 1")
    dog.beat("checkpoint save at step 1", step=False)
    dog.beat("step 2")
    dog.stop()
    assert len(dog.step_times) == 1


def test_flight_recorder_variables_are_set_for_the_backend_unless_already_set(monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_HCCL_TRACE_BUFFER_SIZE", "TORCH_HCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    assert enable_flight_recorder(2000, "npu") == ["TORCH_HCCL_TRACE_BUFFER_SIZE", "TORCH_HCCL_DUMP_ON_TIMEOUT"]
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50" and os.environ["TORCH_HCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert enable_flight_recorder(0, "cuda") == []


def test_hccls_dump_on_timeout_is_asked_only_with_a_trace_buffer():
    # ProcessGroupHCCL.hpp:75-78: TORCH_HCCL_DUMP_ON_TIMEOUT goes with TORCH_HCCL_TRACE_BUFFER_SIZE > 0
    assert flight_recorder_env(0, "npu") == {}
    assert flight_recorder_env(100, "npu")["TORCH_HCCL_DUMP_ON_TIMEOUT"] == "1"


_HANG = textwrap.dedent("""
    import sys, threading
    from titan_npu.reliability.watchdog import Watchdog

    class Quiet(Watchdog):
        def fire(self, *args):
            pass  # stands for a Python thread that cannot run (a stuck call holding the interpreter lock)

    cls = Quiet if sys.argv[2] == "backstop" else Watchdog
    dog = cls(0.5, dump_dir=sys.argv[1], rank=3, poll_s=0.05, backstop_s=1.0, exit_delay_s=0.1)
    dog.start()
    def stuck_in_a_collective():
        dog.beat("step 12")
        threading.Event().wait(60)
    stuck_in_a_collective()
""")


def test_a_hang_dumps_every_thread_and_exits_with_the_hang_code(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _HANG, str(tmp_path), "python"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert time.monotonic() - t0 < 30
    assert "watchdog: rank 3: step 12 has run" in proc.stderr
    assert "stuck_in_a_collective" in proc.stderr and "titan-watchdog" not in proc.stderr
    stacks = (tmp_path / "rank-3-stacks.txt").read_text()
    assert stacks.startswith("watchdog: rank 3: step 12") and "stuck_in_a_collective" in stacks


def test_when_no_python_thread_can_run_faulthandler_still_dumps_and_exits(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _HANG, str(tmp_path), "backstop"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"Timeout \(0:00:01\.\d+\)!", proc.stderr) and "stuck_in_a_collective" in proc.stderr


_LOOP = textwrap.dedent("""
    import sys, threading, time
    from titan_npu.config.schema import JobConfig
    from titan_npu.reliability.run import Reliability

    cfg = JobConfig()
    cfg.metrics.log_dir = sys.argv[1]
    cfg.reliability.watchdog_timeout_s = 0.5
    cfg.reliability.handle_signals = False
    rel = Reliability(cfg, rank=0, world_size=1, device_type="cpu")

    def loop_that_raises():
        rel.start()
        rel.begin_step(1)
        raise RuntimeError("a failed step, and nobody calls finish()")

    try:
        loop_that_raises()
    except RuntimeError:
        pass
    threading.Event().wait(2.0)
    print("still alive after the loop died", flush=True)

    def loop_that_hangs():
        rel.start()
        rel.begin_step(2)
        threading.Event().wait(60)

    loop_that_hangs()
""")


def test_the_watchdog_stands_down_when_its_loop_has_ended_but_still_fires_inside_a_hung_one(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _LOOP, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert "still alive after the loop died" in proc.stdout
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert "watchdog: rank 0: step 2 has run" in proc.stderr and "step 1 has run" not in proc.stderr

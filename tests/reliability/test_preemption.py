"""Signals: the first SIGTERM/SIGINT is a request to stop at the step boundary; a second one ends the process at once.

Each case runs in a small subprocess (no torch) so that real signals reach a real main thread.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

from titan_npu.reliability.preemption import PreemptionHandler

_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from titan_npu.reliability.preemption import PreemptionHandler

    handler = PreemptionHandler(duplicate_window_s={window})
    assert handler.install()
    for delay, sig in {plan}:
        time.sleep(delay)
        os.kill(os.getpid(), sig)
    # Block the main thread the way a collective does, where Python-level handlers cannot run.
    deadline = time.monotonic() + 1.0
    while handler.signum == 0 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    print("recorded", handler.signum, flush=True)
    threading.Event().wait({block})
    handler.uninstall()
    print("uninstalled", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
""")


def _run(plan: list[tuple[float, int]], window: float = 1.0, block: float = 0.5) -> subprocess.CompletedProcess:
    code = _SCRIPT.format(window=window, plan=[(d, int(s)) for d, s in plan], block=block)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_first_signal_is_recorded_and_the_process_carries_on():
    proc = _run([(0.0, signal.SIGTERM)])
    assert proc.returncode == 0, proc.stderr
    assert f"recorded {int(signal.SIGTERM)}" in proc.stdout
    assert "received SIGTERM: finishing the current step, then saving a checkpoint" in proc.stderr


def test_uninstall_gives_the_signals_back():
    proc = _run([])
    assert proc.returncode == 0, proc.stderr
    assert "uninstalled True" in proc.stdout


def test_a_second_signal_exits_at_once_even_while_the_main_thread_is_blocked():
    proc = _run([(0.0, signal.SIGINT), (0.3, signal.SIGTERM)], window=0.1, block=30)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "received SIGTERM again: exiting at once without a checkpoint" in proc.stderr
    assert "uninstalled" not in proc.stdout


def test_copies_of_one_signal_arriving_together_count_once():
    # torchrun forwards the signal it gets; a scheduler may also signal every process: one request, not two.
    proc = _run([(0.0, signal.SIGTERM), (0.0, signal.SIGTERM)], window=5.0)
    assert proc.returncode == 0, proc.stderr
    assert "exiting at once" not in proc.stderr


def test_install_outside_the_main_thread_changes_nothing():
    result = []
    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=lambda: result.append(PreemptionHandler().install()))
    thread.start()
    thread.join()
    assert result == [False] and signal.getsignal(signal.SIGTERM) is before


def test_a_signal_after_the_training_loop_ended_exits_like_the_default_handler():
    code = textwrap.dedent("""
        import os, signal, threading
        from titan_npu.reliability.preemption import PreemptionHandler
        handler = PreemptionHandler()
        handler.loop_running = lambda: False  # the loop raised and nobody called uninstall()
        handler.install()
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(30)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM after training ended: exiting" in proc.stderr

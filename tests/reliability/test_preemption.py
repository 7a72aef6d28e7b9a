"""Signals: the first SIGTERM/SIGINT is a request to stop at the step boundary; a second one ends the process at once.

Each case runs in a small subprocess (no torch) so that real signals reach a real main thread; the last two run the
trainer itself with data-loader workers, which are forked while the handler is installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from titan_npu.reliability.preemption import PreemptionHandler

from .conftest import REPO, clean_env, run_train, tiny_args

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


_FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, signal, threading, time
    from titan_npu.reliability.preemption import PreemptionHandler

    handler = PreemptionHandler()
    handler.install()
    # A child forked while the handler is installed, as data-loader workers are.
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    {body}
""")


def _run_forked(body: str) -> subprocess.CompletedProcess:
    code = _FORK_SCRIPT.format(body=textwrap.dedent(body))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_signal_sent_to_a_forked_child_is_not_a_signal_to_the_process():
    proc = _run_forked("""
        os.kill(child.pid, signal.SIGTERM)
        child.join(timeout=20)
        print("child exit", child.exitcode, flush=True)
        # Bytes of the wakeup pipe are read in order: had the child's signal landed there, it would be seen first.
        os.kill(os.getpid(), signal.SIGINT)
        while handler.signum == 0:
            threading.Event().wait(0.01)
        print("recorded", handler.signum, flush=True)
    """)
    assert proc.returncode == 0, proc.stderr
    assert f"child exit {-signal.SIGTERM}" in proc.stdout  # the child has the default SIGTERM back: it ends
    assert f"recorded {int(signal.SIGINT)}" in proc.stdout, proc.stderr
    assert "SIGTERM" not in proc.stderr


def test_a_forked_child_has_the_handlers_and_wakeup_fd_of_before_install():
    proc = _run_forked("""
        pid = os.fork()
        if pid == 0:
            same = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1
            os._exit(0 if same else 1)
        print("child same", os.waitpid(pid, 0)[1] == 0, flush=True)
        child.kill()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "child same True" in proc.stdout


def test_uninstall_ends_the_watcher_while_a_forked_child_is_alive():
    proc = _run_forked("""
        handler.uninstall()
        alive = [t.name for t in threading.enumerate() if t.name == "titan-signals"]
        print("watchers left", alive, flush=True)
        child.kill()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "watchers left []" in proc.stdout


def test_a_loader_worker_ignores_sigterm_from_others_and_ends_quietly_on_its_parents():
    code = textwrap.dedent("""
        import multiprocessing, os, signal, subprocess, time
        from titan_npu.reliability.preemption import leave_signals_to_parent

        def worker(ready):
            leave_signals_to_parent()  # as the loader's worker_init_fn
            ready.set()
            time.sleep(60)

        ctx = multiprocessing.get_context("fork")
        ready = ctx.Event()
        child = ctx.Process(target=worker, args=(ready,))
        child.start()
        ready.wait(30)
        subprocess.run(["kill", "-TERM", str(child.pid)], check=True)  # a launcher or scheduler, not the parent
        subprocess.run(["kill", "-INT", str(child.pid)], check=True)
        child.terminate()  # the parent: the loader's (or multiprocessing's) own shutdown
        child.join(30)
        print("child exit", child.exitcode, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # 0, not -SIGTERM: the loader's SIGCHLD check raises in the trainer for a worker that died of a signal.
    assert "child exit 0" in proc.stdout, proc.stdout + proc.stderr


def test_a_run_with_data_loader_workers_exits_0(tmp_path):
    # The workers held a copy of the wakeup pipe: the watcher outlived uninstall() and read whatever file later took
    # its descriptor's number as signals ("received SIGINT after training ended", exit 130, in most runs).
    for attempt in range(2):
        run = tmp_path / str(attempt)
        proc = run_train(tiny_args(run, training__max_steps=3, data__num_workers=2))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "received" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_signal_to_the_whole_process_group_with_loader_workers_saves_and_exits_0(tmp_path):
    # torchrun (killpg), Ctrl-C and schedulers signal the loader's workers too: only the trainer acts on it.
    args = tiny_args(tmp_path, training__max_steps=100000, data__num_workers=2)
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=clean_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("[Step 2]"):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "preempted by SIGTERM on rank 0" in out, out[-3000:]


@pytest.mark.parametrize("enable, advice", [
    (True, "run the same command to resume"),
    (False, "the same command starts the run over from step 1 (checkpoint.enable = true keeps the progress)"),
])
def test_the_preemption_message_says_what_running_the_command_again_does(tmp_path, caplog, enable, advice):
    """Without checkpoints the same command cannot resume: the line must not promise it."""
    import logging

    from titan_npu.config.loader import load_config
    from titan_npu.reliability.run import Reliability

    cfg = load_config(None, tiny_args(tmp_path, checkpoint__enable=enable, reliability__watchdog=False))
    reliability = Reliability(cfg, rank=0, world_size=1, device_type="cpu")
    reliability.preempted = (int(signal.SIGTERM), 0)
    saved = []
    checkpointer = type("Checkpointer", (), {"save": lambda self, step, sync: saved.append(step)})()
    logger = logging.getLogger("titan_npu")
    logger.addHandler(caplog.handler)
    try:
        reliability.stop(checkpointer, 3)
    finally:
        logger.removeHandler(caplog.handler)
    assert saved == [3]
    (line,) = {r.getMessage() for r in caplog.records if r.getMessage().startswith("preempted by")}
    assert line.startswith("preempted by SIGTERM on rank 0 after step 3: the run is ") and line.endswith(advice), line

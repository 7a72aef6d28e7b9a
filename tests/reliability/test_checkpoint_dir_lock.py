"""One run at a time owns a checkpoint directory: a second `python train.py` on it is refused in one line naming the
owner (host, pid, since when) and the fix; a run killed with -9 leaves nothing stuck; the restarted attempt of a
torchrun job whose rank 0 died takes the lock over and resumes. Real processes throughout."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.lock import LOCK_FILE, current_owner, read_owner

from .conftest import REPO, checkpoint_steps, clean_env, run_train, tiny_args, torchrun


def _start(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=clean_env(**env), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for_owner(ckpt: Path, pid: int, proc: subprocess.Popen, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owner = read_owner(ckpt)
        if owner.get("pid") == pid:
            return owner
        assert proc.poll() is None, f"the first run ended early: {proc.stderr.read()[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(f"pid {pid} never took the lock of {ckpt}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.fixture
def long_run(tmp_path):
    """A `python train.py` that trains for long on tmp_path/run, holding its checkpoint.dir; killed at the end."""
    run = tmp_path / "run"
    proc = _start(tiny_args(run, training__max_steps=100000, checkpoint__save_interval=5,
                            checkpoint__async_save=False, checkpoint__keep_last_n=2))
    try:
        yield run, proc, _wait_for_owner(run / "ckpt", proc.pid, proc)
    finally:
        _kill(proc)


def test_a_second_run_on_the_same_checkpoint_dir_is_refused_in_one_line_naming_the_owner(long_run):
    run, first, owner = long_run
    second = run_train(tiny_args(run, training__max_steps=2))
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr, second.stderr
    line = second.stderr.strip()
    assert line.startswith(f"CheckpointError: checkpoint.dir={run / 'ckpt'} is in use by another run "
                           f"(pid {first.pid} on host {socket.gethostname()} since {owner['since']})"), line
    assert "wait for it to end or stop it, or give this run another --checkpoint.dir" in line
    assert first.poll() is None, "the refused run disturbed the owner"
    assert read_owner(run / "ckpt")["pid"] == first.pid


def test_a_run_killed_with_9_does_not_keep_the_next_run_out(long_run):
    run, first, _ = long_run
    _kill(first)  # SIGKILL: no cleanup ran, the lock file stays behind
    assert (run / "ckpt" / LOCK_FILE).exists()
    steps = checkpoint_steps(run)
    later = run_train(tiny_args(run, training__max_steps=(steps[-1] if steps else 0) + 1,
                                checkpoint__async_save=False))
    assert later.returncode == 0, later.stderr[-2000:]
    assert not (run / "ckpt" / LOCK_FILE).exists(), "a run that ended left its lock file"


def test_a_finished_run_leaves_no_lock_and_a_refused_one_no_folder(tmp_path):
    done = run_train(tiny_args(tmp_path / "a", training__max_steps=1, checkpoint__async_save=False))
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "a" / "ckpt" / LOCK_FILE).exists() and checkpoint_steps(tmp_path / "a") == [1]
    refused = run_train(tiny_args(tmp_path / "b", training__max_steps=1, checkpoint__resume="7"))
    assert refused.returncode == 2 and "does not exist" in refused.stderr, refused.stderr
    assert not (tmp_path / "b").exists(), "a refused run left a folder"


def test_torchrun_restarts_after_rank_0_is_killed_take_the_lock_over_and_resume(tmp_path):
    proc = torchrun(tiny_args(tmp_path, training__max_steps=4, checkpoint__save_interval=1,
                              checkpoint__async_save=False),
                    max_restarts=1, TITAN_FAULT_KILL_AT_STEP="3", TITAN_FAULT_RANK="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint: loaded step 2 from" in proc.stdout + proc.stderr
    assert checkpoint_steps(tmp_path)[-1] == 4
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
    # Rank 0 recorded both ranks' files; two rank files swapped are found out by content.
    step4 = tmp_path / "ckpt" / "step-4"
    assert {"ranks/rank-1.pt", "__1_0.distcp"} <= set(storage.read_info(step4)[storage.FILES_KEY])
    ranks = step4 / "ranks"
    (ranks / "rank-0.pt").rename(ranks / "swap")
    (ranks / "rank-1.pt").rename(ranks / "rank-0.pt")
    (ranks / "swap").rename(ranks / "rank-1.pt")
    assert re.search(r"rank-0\.pt (is not the file this checkpoint saved|is \d+ bytes but checkpoint.json recorded)",
                     storage.recorded_problem(step4))


_HOLD = ("import sys, time; from titan_npu.checkpoint.lock import acquire; acquire(sys.argv[1]); "
         "print('held', flush=True); time.sleep(600)")


def _holder(ckpt: Path, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(ckpt)], cwd=REPO, env=clean_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def test_the_restarted_attempt_of_the_same_job_waits_for_its_previous_attempt_to_go(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = _holder(ckpt, TORCHELASTIC_RUN_ID="job-1", TORCHELASTIC_RESTART_COUNT="0")
    try:
        new = subprocess.Popen([sys.executable, "-c", _HOLD, str(ckpt)], cwd=REPO, text=True,
                               env=clean_env(TORCHELASTIC_RUN_ID="job-1", TORCHELASTIC_RESTART_COUNT="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        time.sleep(1.0)
        assert new.poll() is None, new.stderr.read()  # waiting, not refused
        _kill(old)  # the agent stops the old attempt: the lock goes with it
        assert new.stdout.readline().strip() == "held", new.stderr.read()
        assert read_owner(ckpt)["pid"] == new.pid and read_owner(ckpt)["restart"] == 1
        other = subprocess.run([sys.executable, "-c", _HOLD, str(ckpt)], cwd=REPO, capture_output=True, text=True,
                               env=clean_env(TORCHELASTIC_RUN_ID="job-2", TORCHELASTIC_RESTART_COUNT="1"),
                               timeout=60)
        assert other.returncode != 0 and f"in use by another run (pid {new.pid}" in other.stderr  # another job
        _kill(new)
    finally:
        _kill(old)


def test_current_owner_names_the_process_holding_the_lock_and_none_once_it_is_gone(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert current_owner(ckpt) is None and not ckpt.exists()  # looks only
    holder = _holder(ckpt)
    try:
        assert current_owner(ckpt)["pid"] == holder.pid
        assert current_owner(ckpt)["pid"] == holder.pid  # asking does not take it away
    finally:
        _kill(holder)
    assert current_owner(ckpt) is None  # kill -9: the file stays, the lock went with the process


def test_a_run_on_a_checkpoint_dir_in_use_is_refused_before_it_builds_anything(tmp_path, capsys):
    from titan_npu.cli import main as cli_main

    holder = _holder(tmp_path / "ckpt")
    try:
        capsys.readouterr()
        rc = cli_main(["train", *tiny_args(tmp_path, training__max_steps=1)])
        err = capsys.readouterr().err
    finally:
        _kill(holder)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"is in use by another run (pid {holder.pid} on host {socket.gethostname()} since" in err
    assert not (tmp_path / "logs").exists()


def test_a_rank_whose_own_jobs_rank_0_holds_the_lock_starts_and_another_job_is_refused(tmp_path, monkeypatch):
    """Rank 0 takes the lock while its peers start: a peer (same MASTER_ADDR:MASTER_PORT, job and attempt) is let
    through; a process of another rendezvous, or a single process, is refused."""
    from titan_npu.checkpoint.lock import refuse_if_owned
    from titan_npu.errors import CheckpointError

    ckpt = tmp_path / "ckpt"
    job = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29777", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="job-1",
               TORCHELASTIC_RESTART_COUNT="0")
    holder = _holder(ckpt, RANK="0", **job)
    try:
        for name in ("RANK", "LOCAL_RANK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in {**job, "RANK": "1"}.items():
            monkeypatch.setenv(name, value)
        refuse_if_owned(ckpt)  # rank 1 of the same attempt
        monkeypatch.setenv("MASTER_PORT", "29778")
        with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {holder.pid}"):
            refuse_if_owned(ckpt)
        monkeypatch.setenv("MASTER_PORT", "29777")
        monkeypatch.setenv("WORLD_SIZE", "1")
        with pytest.raises(CheckpointError, match="in use by another run"):
            refuse_if_owned(ckpt)
    finally:
        _kill(holder)

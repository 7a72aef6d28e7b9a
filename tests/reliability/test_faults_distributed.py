"""Fault injection on 2 gloo ranks under torchrun, deterministic fp32: every fault ends in the weights of the
uninterrupted run, or in a prompt exit with stacks.

All runs share one reference: 8 steps in which rank 1 sees a NaN loss at step 3 (tests/fault_hooks.py, a bad
batch that is bad every time it is read). The faulty runs add a kill, a signal or a crash in a save on top and
must end with the reference's final weights, bit for bit.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from titan_npu.config.schema import CommConfig
from titan_npu.device.detect import DeviceInfo
from titan_npu.errors import DeviceError
from titan_npu.parallel.process_group import free_port, init_process_group, job_store

from .conftest import (
    REPO,
    checkpoint_steps,
    clean_env,
    model_weights,
    records,
    tiny_args,
    torchrun,
    torchrun_command,
    train_script,
)

pytestmark = pytest.mark.distributed

STEPS = 8
NAN_ON_RANK_1 = {"TITAN_FAULT_NAN_AT_STEP": "3", "TITAN_FAULT_RANK": "1"}


def _args(run_dir, save_interval=1):
    return tiny_args(run_dir, training__max_steps=STEPS, checkpoint__save_interval=save_interval,
                     checkpoint__keep_last_n=20, checkpoint__async_save=False)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    proc = torchrun(_args(run), **NAN_ON_RANK_1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_a_nan_on_one_rank_is_skipped_by_every_rank_and_training_continues(reference):
    run, proc = reference
    assert "step 3: update skipped (non-finite loss on rank 1); 1 in a row" in proc.stdout
    by_step = {r["step"]: r for r in records(run)}
    assert math.isnan(float(by_step[3]["loss"])) and math.isfinite(by_step[STEPS]["loss"])
    assert [by_step[s]["skipped_steps"] for s in range(1, STEPS + 1)] == [0, 0] + [1] * (STEPS - 2)
    ckpt = run / "ckpt"
    # Both shards unchanged by step 3: rank 0 skipped the update too, though its own loss was finite.
    assert _same(model_weights(ckpt / "step-2"), model_weights(ckpt / "step-3"))
    assert not _same(model_weights(ckpt / "step-3"), model_weights(ckpt / "step-4"))


def test_kill_9_of_one_rank_at_a_random_step_under_max_restarts_ends_with_the_same_weights(reference, tmp_path):
    ref, _ = reference
    k = random.randint(2, STEPS - 1)
    proc = torchrun(_args(tmp_path), max_restarts=1, TITAN_FAULT_KILL_AT_STEP=str(k), **NAN_ON_RANK_1)
    assert proc.returncode == 0, f"killed at step {k}: {proc.stderr[-3000:]}"
    assert f"checkpoint: loaded step {k - 1} from" in proc.stdout, f"killed at step {k}"
    assert _same(model_weights(tmp_path / "ckpt" / f"step-{STEPS}"), model_weights(ref / "ckpt" / f"step-{STEPS}")), \
        f"killed at step {k}"
    assert records(tmp_path)[-1]["skipped_steps"] == 1


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker that torchrun (launcher_pid) started as `rank`, or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                parent = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (OSError, StopIteration):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_kill_9_from_outside_under_plain_torchrun_resumes_to_the_same_weights(reference, tmp_path, rdzv):
    # The guide's command, no extra environment: torchrun's store outlives the killed attempt. The script is
    # train.py with the reference's NaN hook (train.py itself reads no TITAN_FAULT_* variable).
    ref, _ = reference
    k = random.randint(2, STEPS - 2)
    env = dict(NAN_ON_RANK_1)  # the reference run's NaN, injected the same way
    cmd = [*torchrun_command(max_restarts=1, rdzv=rdzv), train_script(env), *_args(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(**env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines, killed = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith(f"[Step {k}]"):
                killed = _rank_pid(proc.pid, 1)
                os.kill(killed, signal.SIGKILL)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert killed and proc.returncode == 0, f"rank 1 killed after step {k}: {out[-3000:]}"
    assert "checkpoint: loaded step" in out
    assert _same(model_weights(tmp_path / "ckpt" / f"step-{STEPS}"), model_weights(ref / "ckpt" / f"step-{STEPS}")), \
        f"rank 1 killed after step {k}"


def test_a_restarted_attempt_does_not_see_the_keys_of_the_previous_one(monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # as torchrun hosts it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    job_store(0, 2, timeout_s=10).set("default_pg/0//cpu/rank_1", "the address of a process now dead")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not job_store(0, 2, timeout_s=10).check(["default_pg/0//cpu/rank_1"])


def test_ranks_that_never_join_end_process_group_formation_with_one_line_naming_them(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(DeviceError) as failed:
        init_process_group(DeviceInfo("cpu", 0, "gloo"), CommConfig(join_timeout_s=1, init_timeout_s=10))
    message = str(failed.value)
    assert message.startswith("rank(s) 1, 2 of 3 did not join the process group within comm.join_timeout_s=1s")
    assert "\n" not in message and not dist.is_initialized()


def test_sigterm_saves_and_exits_0_and_the_same_command_resumes_to_the_same_weights(reference, tmp_path):
    ref, _ = reference
    args = _args(tmp_path, save_interval=3)  # step 4 is saved only because of the signal
    first = torchrun(args, TITAN_FAULT_SIGNAL_AT_STEP="4", **NAN_ON_RANK_1)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "received SIGTERM: finishing the current step, then saving a checkpoint" in first.stdout
    assert (f"preempted by SIGTERM on rank 1 after step 4: the run is saved in {tmp_path / 'ckpt' / 'step-4'}; "
            "run the same command to resume") in first.stdout
    assert checkpoint_steps(tmp_path) == [3, 4]

    second = torchrun(args, TITAN_FAULT_SIGNAL_AT_STEP="4", **NAN_ON_RANK_1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "checkpoint: loaded step 4 from" in second.stdout
    assert _same(model_weights(tmp_path / "ckpt" / f"step-{STEPS}"), model_weights(ref / "ckpt" / f"step-{STEPS}"))


def test_a_crash_during_a_checkpoint_write_resumes_from_the_previous_checkpoint(reference, tmp_path):
    ref, _ = reference
    proc = torchrun(_args(tmp_path), max_restarts=1, TITAN_FAULT_KILL_IN_SAVE_AT_STEP="4", **NAN_ON_RANK_1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint: loaded step 3 from" in proc.stdout
    assert _same(model_weights(tmp_path / "ckpt" / f"step-{STEPS}"), model_weights(ref / "ckpt" / f"step-{STEPS}"))


def test_a_rank_that_stops_answering_ends_the_job_with_every_stack_within_the_timeout(tmp_path):
    limit = 3
    t0 = time.monotonic()
    proc = torchrun(tiny_args(tmp_path, training__max_steps=6, reliability__watchdog_timeout_s=limit),
                    TITAN_FAULT_HANG_AT_STEP="3", TITAN_FAULT_RANK="1", timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "exitcode  : 124" in proc.stderr  # torchrun's summary: the watchdog's exit code
    for rank in (0, 1):
        fired = re.search(rf"watchdog: rank {rank}: step 3 has run (\d+)s, over its limit of {limit}s", proc.stderr)
        assert fired and int(fired.group(1)) <= limit + 5, proc.stderr[-3000:]
        stacks = (tmp_path / "logs" / "watchdog" / f"rank-{rank}-stacks.txt").read_text()
        assert "titan_npu/trainer/trainer.py" in stacks
        recorder = (tmp_path / "logs" / "watchdog" / f"rank-{rank}-flight-recorder.json").read_text()
        assert '"profiling_name"' in recorder
    assert "in at_step_start" in (tmp_path / "logs" / "watchdog" / "rank-1-stacks.txt").read_text()
    assert elapsed < 150

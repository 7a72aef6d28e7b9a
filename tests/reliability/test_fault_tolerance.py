"""Fault tolerance on torchft: two replica groups (one process each, CPU, gloo, loopback) under a lighthouse.

Group 1 is killed with SIGKILL after its step 3. Group 0 steps on alone (no step lost or repeated), then holds at
the start of step 7 until group 1 has been started again and asks to join; group 1 heals from group 0's live state
(no checkpoint read) and both finish step 10 with the same weights, bit for bit. The final loss stays within
LOSS_TOLERANCE of an uninterrupted run: the steps trained by one group alone had half the global batch.

The uninterrupted reference is one process with both groups' batch (batch_size 4): two groups of batch_size 2 read
slices 0 and 1 of the same windows and average their gradients, which is that run up to rounding.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tiny_run import train_tiny

from titan_npu.cli import main as cli_main
from titan_npu.parallel.process_group import free_port

from .conftest import REPO, clean_env, model_weights, tiny_args, train_script

pytestmark = pytest.mark.distributed
pytest.importorskip("torchft", reason="fault tolerance needs torchft (pip install 'titan-npu[ft]')")

STEPS = 10
KILL_AFTER = 3  # group 1 dies once it has logged this step
HOLD_AT = 7  # group 0 waits at the start of this step until group 1 is back
HEALED_WITHIN = 3  # steps after group 0 goes on by which group 1 trains again, healed
LOSS_TOLERANCE = 0.1  # |final loss - uninterrupted run's| (loss ~4.4 after 10 steps; the gap measured: 0.027)
WAIT_S = 120  # bound on every wait for a line of a group's log


@contextmanager
def lighthouse():
    """A torchft lighthouse on a free loopback port: any one group makes a quorum; a group that stops heartbeating
    for 1 s has left; a starting group waits up to 30 s for a heartbeating peer to join."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust side starts logging (each quorum at info)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30_000, heartbeat_timeout_ms=1_000)
    try:
        yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


def _group_args(run: Path, replica_id: int, address: str) -> list[str]:
    return tiny_args(run, training__max_steps=STEPS, checkpoint__save_interval=2, checkpoint__keep_last_n=20,
                     checkpoint__async_save=False, fault_tolerance__enable=True,
                     fault_tolerance__replica_id=replica_id, fault_tolerance__num_replica_groups=2,
                     fault_tolerance__lighthouse=address, fault_tolerance__hostname="127.0.0.1",
                     fault_tolerance__timeout_s=30, fault_tolerance__connect_timeout_s=10)


def _start(run: Path, replica_id: int, address: str, log: Path, nproc: int = 1, **env: str) -> subprocess.Popen:
    """One replica group: `python train.py` (or the fault-hook script, with TITAN_FAULT_* in env), or torchrun of
    nproc processes (FSDP inside the group), in its own session."""
    full = clean_env(**env)
    script = train_script(env)
    full.update(env)
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port", str(free_port())]
    with open(log, "w") as out:
        return subprocess.Popen([*launch, script, *_group_args(run, replica_id, address)], cwd=REPO, env=full,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(log: Path, text: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if text in log.read_text():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {log.name} (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def _wait_for_a_quorum_request(address: str, proc: subprocess.Popen) -> None:
    """Until a group waits at the lighthouse for a quorum (its status page counts the groups asking)."""
    import urllib.request

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        status = urllib.request.urlopen(f"{address}/status", timeout=5).read().decode()
        if re.search(r"\[[1-9]\d*/\d+ participants healthy\]", status):
            return
        time.sleep(0.05)
    raise AssertionError(f"no group asked the lighthouse for a quorum (exit {proc.poll()})")


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the group: its process and, under torchrun, the workers (each in a session of its own)."""
    if proc.poll() is None:
        for child in _children(proc.pid):
            os.kill(child, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        for proc, log in zip(procs, logs):
            assert proc.wait(timeout=WAIT_S) == 0, f"{log.name}:\n{log.read_text()[-3000:]}"
    finally:
        for proc in procs:
            _kill(proc)


def _records(run: Path, replica_id: int) -> list[dict]:
    lines = (run / "logs" / f"replica_{replica_id}" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]


def _final_weights(run: Path, replica_id: int) -> dict[str, torch.Tensor]:
    return model_weights(run / "ckpt" / f"replica_{replica_id}" / f"step-{STEPS}")


def _start_both(run: Path, address: str, logs: list[Path], env: list[dict[str, str]], nproc: int = 1
                ) -> list[subprocess.Popen]:
    """Both groups, training from the moment both managers are up: the first quorum holds both."""
    gate = run / "start"
    procs = [_start(run, i, address, logs[i], nproc, TITAN_FAULT_START_WHEN=str(gate), **env[i]) for i in (0, 1)]
    try:
        for i in (0, 1):
            _wait_for(logs[i], f"fault tolerance: replica group {i} of 2", procs[i])
    except BaseException:
        for proc in procs:
            _kill(proc)
        raise
    gate.touch()
    return procs


def run_uninterrupted(run: Path) -> None:
    """Both groups from the first step to the last."""
    with lighthouse() as address:
        logs = [run / "group0.log", run / "group1.log"]
        _finish(_start_both(run, address, logs, [{}, {}]), logs)


def run_with_a_kill(run: Path, heal: bool = True, nproc: int = 1) -> None:
    """Group 1 killed after step KILL_AFTER and started again while group 0 holds at step HOLD_AT."""
    release = run / "release"
    hold = {"TITAN_FAULT_WAIT_AT_STEP": str(HOLD_AT), "TITAN_FAULT_WAIT_FOR": str(release)}
    no_heal = {} if heal else {"TITAN_FAULT_NO_HEAL": "1"}
    with lighthouse() as address:
        logs = [run / "group0.log", run / "group1.log", run / "group1-restart.log"]
        procs = _start_both(run, address, logs, [hold, no_heal], nproc)
        first = procs[0]
        try:
            _wait_for(logs[1], f"[Step {KILL_AFTER}]", procs[1])
            _kill(procs[1])
            _wait_for(logs[0], f"[Step {HOLD_AT - 1}]", first)
            procs[1] = _start(run, 1, address, logs[2], nproc, **no_heal)
            _wait_for_a_quorum_request(address, procs[1])  # group 0 holds past its own quorum: this is group 1
            release.touch()
        except BaseException:
            for proc in procs:
                _kill(proc)
            raise
        _finish(procs, [logs[0], logs[2]])


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1-process", "2-fsdp-ranks"])
def test_a_killed_replica_group_leaves_the_other_steps_on_and_the_restarted_one_heals_to_the_same_weights(
        nproc, tmp_path, one_thread):
    run_with_a_kill(tmp_path, nproc=nproc)
    survivor = _records(tmp_path, 0)
    # Every step of the survivor ran exactly once, some with group 1 away, the last ones with both groups again.
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1))
    replicas = [r["replicas"] for r in survivor]
    assert 1 in replicas[KILL_AFTER:HOLD_AT] and replicas[-1] == 2, replicas
    log0 = (tmp_path / "group0.log").read_text()
    assert log0.count("group(s) [1] left") == 1 and log0.count("group(s) [1] joined") == 1, log0[-3000:]
    # The restarted group healed from the live survivor, within HEALED_WITHIN steps, and trained to the end.
    restart = (tmp_path / "group1-restart.log").read_text()
    assert "healed from a live peer" in restart, restart[-3000:]
    back = [r["step"] for r in _records(tmp_path, 1)]
    # Before the kill group 1 logged steps 1, 2, ... (at least KILL_AFTER; a step takes ~10 ms, so one or two more
    # may land between the line the test waits for and the kill); after it, the restarted group's, healed.
    before = next((i for i, s in enumerate(back) if s != i + 1), len(back))
    resumed = back[before:]
    assert before >= KILL_AFTER and back[-1] == STEPS, back
    if resumed:  # (none when the restart healed to the step right after the last one logged before the kill)
        assert resumed == list(range(resumed[0], STEPS + 1)) and resumed[0] <= HOLD_AT + HEALED_WITHIN, back
    # Bit for bit the same model in both groups' last checkpoints.
    a, b = _final_weights(tmp_path, 0), _final_weights(tmp_path, 1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])]
    # Close to the run nobody interrupted: the last step's loss over both groups' halves of the batch.
    final = (survivor[-1]["loss"] + _records(tmp_path, 1)[-1]["loss"]) / 2
    reference = one_process_reference(tmp_path / "reference", 4 * nproc)[-1]  # 2 groups x nproc ranks x 2
    assert reference["step"] == STEPS and abs(final - reference["loss"]) < LOSS_TOLERANCE, (final, reference["loss"])


def one_process_reference(run: Path, batch_size: int) -> list[dict]:
    """The uninterrupted run in this process: both groups' batch at once."""
    train_tiny(run, steps=STEPS, training__batch_size=batch_size, checkpoint__enable=False)
    lines = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss" in r]


@pytest.mark.slow
def test_without_live_recovery_the_restarted_group_does_not_end_with_the_survivors_weights(tmp_path):
    """The same kill with torchft's healing turned off (the restarted group trains on from its own checkpoint):
    what the assertions above hold the recovery to."""
    run_with_a_kill(tmp_path, heal=False)
    assert "healed from a live peer" not in (tmp_path / "group1-restart.log").read_text()
    a, b = _final_weights(tmp_path, 0), _final_weights(tmp_path, 1)
    assert not all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    run_uninterrupted(run)
    return run


@pytest.mark.slow
def test_an_uninterrupted_pair_of_replica_groups_trains_like_one_process_with_both_batches(uninterrupted, tmp_path,
                                                                                          one_thread):
    groups = [_records(uninterrupted, 0), _records(uninterrupted, 1)]
    assert [r["replicas"] for r in groups[0]] == [2] * STEPS
    a, b = _final_weights(uninterrupted, 0), _final_weights(uninterrupted, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Each group trained its own half of every step's windows and the gradients were averaged: the mean of the two
    # groups' losses is the loss of one process reading both halves, step by step (up to summation order).
    reference = one_process_reference(tmp_path, 4)
    means = [(r0["loss"] + r1["loss"]) / 2 for r0, r1 in zip(*groups)]
    assert max(abs(m - r["loss"]) for m, r in zip(means, reference)) < 1e-3, (means, [r["loss"] for r in reference])
    assert [r["grad_norm"] for r in groups[0]] == [r["grad_norm"] for r in groups[1]]


@pytest.mark.slow
def test_a_full_restart_of_every_replica_group_resumes_exactly(uninterrupted, tmp_path):
    """Both groups killed after step 5 (checkpoints every 2 steps) and started again: the same final weights."""
    with lighthouse() as address:
        logs = [tmp_path / "group0.log", tmp_path / "group1.log"]
        procs = _start_both(tmp_path, address, logs, [{}, {}])
        try:
            for proc, log in zip(procs, logs):
                _wait_for(log, "[Step 5]", proc)
        finally:
            for proc in procs:
                _kill(proc)
        logs = [tmp_path / "group0-restart.log", tmp_path / "group1-restart.log"]
        _finish(_start_both(tmp_path, address, logs, [{}, {}]), logs)
    for i in (0, 1):
        assert "checkpoint: loaded step" in logs[i].read_text()
        a, b = _final_weights(uninterrupted, i), _final_weights(tmp_path, i)
        assert all(torch.equal(a[k], b[k]) for k in a), i
        assert _records(tmp_path, i)[-1]["loss"] == _records(uninterrupted, i)[-1]["loss"]


@pytest.fixture
def silent_port():
    """A loopback port that accepts connections and never answers them (a lighthouse that hangs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_an_unreachable_lighthouse_is_one_line_naming_it_within_the_connect_timeout(kind, tmp_path, capsys,
                                                                                      monkeypatch, silent_port):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    port = free_port() if kind == "refused" else silent_port
    address = f"http://127.0.0.1:{port}"
    args = tiny_args(tmp_path, training__max_steps=1, fault_tolerance__enable=True, fault_tolerance__lighthouse=address,
                     fault_tolerance__connect_timeout_s=2)
    capsys.readouterr()
    started = time.monotonic()
    rc = cli_main(["train", *args])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert not any(tmp_path.iterdir()), "a refused run wrote into its folder"
    assert err[0].startswith("DeviceError: fault_tolerance.lighthouse " + address + " is unreachable within "
                             "fault_tolerance.connect_timeout_s = 2 s"), err
    assert elapsed < 2 + 10, elapsed  # the timeout, plus the tiny model's set-up

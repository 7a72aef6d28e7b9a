"""A rank lost under torchrun (kill -9, the out-of-memory killer, its own error): the survivors say in one line which
rank ended, not gloo's frames, and torchrun's summary names the lost rank as the root cause. A rank whose peers
reached the job's store but never the process group gets one line naming them, not a store timeout.

Real torchrun runs on 2 gloo CPU ranks (tests/train_with_faults.py injects the fault on rank 1), a few seconds each.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from titan_npu.config.schema import CommConfig
from titan_npu.device.detect import DeviceInfo
from titan_npu.errors import DeviceError
from titan_npu.parallel.process_group import free_port, init_process_group

from .conftest import REPO, clean_env, tiny_args, torchrun

pytestmark = pytest.mark.distributed


def _root_cause_rank(stderr: str) -> int:
    """The rank torchrun's failure summary gives as the root cause (first observed failure)."""
    found = re.search(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", stderr, re.DOTALL)
    assert found, stderr[-3000:]
    return int(found.group(1))


def _worker_output(stderr: str) -> str:
    """What the workers printed: stderr up to torchrun's own report."""
    return re.split(r"^[EW]\d{4} .*torch/distributed/elastic", stderr, maxsplit=1, flags=re.MULTILINE)[0]


def test_a_rank_killed_mid_run_is_named_by_the_survivor_in_one_line_and_is_torchruns_root_cause(tmp_path):
    t0 = time.monotonic()
    proc = torchrun(tiny_args(tmp_path, training__max_steps=8, checkpoint__enable=False),
                    TITAN_FAULT_KILL_AT_STEP="3", TITAN_FAULT_RANK="1", timeout=120)
    assert proc.returncode != 0
    workers = _worker_output(proc.stderr)
    said = [line for line in workers.splitlines() if "Error" in line]
    assert len(said) == 1, workers[-3000:]
    assert said[0].startswith("DeviceError: rank 1 of 2 ended at step 3 (killed"), said[0]
    assert "Traceback" not in workers and "pair.cc" not in proc.stderr
    assert _root_cause_rank(proc.stderr) == 1
    assert "Signal 9 (SIGKILL)" in proc.stderr
    assert time.monotonic() - t0 < 60  # the survivor waits for torchrun to stop it, not its full grace period


def test_a_rank_that_fails_with_its_own_error_is_torchruns_root_cause_and_the_survivor_names_it(tmp_path):
    proc = torchrun(tiny_args(tmp_path, training__max_steps=8, checkpoint__enable=False),
                    TITAN_FAULT_OSERROR_AT_STEP="3", TITAN_FAULT_RANK="1", timeout=120)
    assert proc.returncode != 0
    workers = _worker_output(proc.stderr)
    assert "Traceback" not in workers and "pair.cc" not in proc.stderr, workers[-3000:]
    said = [line for line in workers.splitlines() if "Error" in line]
    assert len(said) == 2, workers[-3000:]
    own = "[rank1] PermissionError: Permission denied (EACCES): /data/shards/shard_00003.bin; check its permissions"
    assert any(line.startswith(own) for line in said), said
    assert any(line.startswith("DeviceError: rank 1 of 2 ended at step 3") for line in said), said
    assert _root_cause_rank(proc.stderr) == 1
    summary = proc.stderr.split("Root Cause")[1]
    assert "PermissionError: Permission denied (EACCES): /data/shards/shard_00003.bin" in summary


def test_a_peer_that_joined_the_store_and_ended_before_the_process_group_is_named_in_one_line(monkeypatch):
    port = free_port()
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Rank 1 reaches the store as init_process_group does (its host and pid, then "joined"), then dies.
    peer = subprocess.Popen([sys.executable, "-c", (
        "import os, socket, torch.distributed as dist\n"
        f"s = dist.TCPStore('127.0.0.1', {port}, 2, is_master=False)\n"
        "s.set('titan/process/1', f'{socket.gethostname()} {os.getpid()}')\n"
        "s.set('titan/joined/1', '1')\n"
        "os._exit(0)\n")], cwd=REPO, env=clean_env(), stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(DeviceError) as failed:
            init_process_group(DeviceInfo("cpu", 0, "gloo"), CommConfig(join_timeout_s=30, init_timeout_s=3))
    finally:
        peer.wait(timeout=30)
    message = str(failed.value)
    assert message.startswith("rank 1 of 2 ended before the process group formed"), message
    assert "\n" not in message and not dist.is_initialized()


def test_a_peer_that_joined_the_store_but_never_the_process_group_is_named_in_one_line(monkeypatch):
    port = free_port()
    for name, value in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    stop = threading.Event()

    def stuck_peers() -> None:  # ranks 1 and 2 (on another host) reach the store and then hang
        store = None
        while store is None and not stop.is_set():
            try:
                store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=__import__("datetime")
                                      .timedelta(seconds=5))
            except Exception:
                time.sleep(0.1)
        for rank in (1, 2):
            store.set(f"titan/process/{rank}", "another-host 1")
            store.set(f"titan/joined/{rank}", "1")
        stop.wait(30)

    thread = threading.Thread(target=stuck_peers, daemon=True)
    thread.start()
    try:
        with pytest.raises(DeviceError) as failed:
            init_process_group(DeviceInfo("cpu", 0, "gloo"), CommConfig(join_timeout_s=30, init_timeout_s=2))
    finally:
        stop.set()
    message = str(failed.value)
    assert re.match(r"rank\(s\) [12](, 2)? of 3 reached the job's store but did not join the process group within "
                    r"comm.init_timeout_s=2s", message), message
    assert "\n" not in message and "could not reach the master" not in message

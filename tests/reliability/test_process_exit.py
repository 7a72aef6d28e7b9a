"""A training process ends with its own exit code, whatever torch's C++ threads are doing when it exits.

A gloo worker thread that finishes a collective late (a loaded machine) drops the last C++ reference to a tensor with
a Python object, and so takes the interpreter lock, after the main thread has begun to exit. Should the interpreter
be torn down meanwhile, Python ends that thread inside a noexcept destructor and the process aborts ("terminate
called without an active exception", SIGABRT) after a run that succeeded: under torchrun, a failed job.

The race is made certain here: rank 1 joins the collective only once rank 0 has begun to exit, and rank 0's last exit
handler holds the interpreter lock for about a second (a long sum in C, no bytecode), so rank 0's worker thread
finishes the collective and waits for the lock until the interpreter is torn down.
"""

from __future__ import annotations

import subprocess
import sys

from titan_npu.parallel.process_group import free_port

from .conftest import REPO, clean_env

# Rank 0 runs train.py's entry, with the run replaced by: join a gloo group, start a collective, close as the Trainer
# does (destroy_process_group) and return 0 while the collective's worker still holds the tensor.
RANK_0 = """
import atexit, sys
atexit.register(sum, range(10**8))  # registered first, so it runs last: holds the interpreter lock in C
import torch, torch.distributed as dist
import titan_npu.commands.train

store = dist.TCPStore("127.0.0.1", PORT, 2, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=2)
group = dist.new_group(backend="gloo")
tensor = torch.ones(1000)

def run(argv):
    dist.all_reduce(tensor, group=group, async_op=True)  # rank 1 joins once this process is exiting
    atexit.register(store.set, "exiting", "1")  # runs just before the sum
    dist.destroy_process_group()
    return 0

titan_npu.commands.train.main = run
titan_npu.commands.train.cli_main()
"""

RANK_1 = """
import os, torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", PORT, 2, is_master=False)
dist.init_process_group("gloo", store=store, rank=1, world_size=2)
group = dist.new_group(backend="gloo")
store.wait(["exiting"])
dist.all_reduce(torch.ones(1000), group=group)
os._exit(0)
"""


def test_a_collective_finishing_while_the_process_exits_does_not_abort_the_exit():
    for _ in range(2):
        port = free_port()
        env = clean_env(PYTHONPATH=str(REPO))
        peer = subprocess.Popen([sys.executable, "-c", RANK_1.replace("PORT", str(port))], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc = subprocess.run([sys.executable, "-c", RANK_0.replace("PORT", str(port))], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=120)
        finally:
            peer.kill()
            peer.wait()
        assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
        assert proc.returncode == 0, proc.stderr[-2000:]

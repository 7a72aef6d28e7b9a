"""Fault injection for the tests: hooks installed on a Trainer that make the run fail on purpose at a chosen step.

Imported as `fault_hooks` (tests/ is on sys.path, as for tiny_run). A subprocess run reads the faults from these
environment variables through tests/train_with_faults.py:

    TITAN_FAULT_NAN_AT_STEP=k           the loss of step k becomes NaN (so do its gradients)
    TITAN_FAULT_KILL_AT_STEP=k          SIGKILL at the start of step k
    TITAN_FAULT_SIGNAL_AT_STEP=k        SIGTERM to itself at the start of step k (the preemption path)
    TITAN_FAULT_HANG_AT_STEP=k          stop answering at the start of step k (sleep for an hour)
    TITAN_FAULT_KILL_IN_SAVE_AT_STEP=k  SIGKILL while step k's checkpoint is being written
    TITAN_FAULT_OSERROR_AT_STEP=k       at the start of step k, a PermissionError on a data shard (as the kernel
                                        raises it when a shard's permissions change under a run)
    TITAN_FAULT_RANK=r                  only rank r misbehaves (default: every rank)
    TITAN_FAULT_WAIT_AT_STEP=k          at the start of step k, wait until the file TITAN_FAULT_WAIT_FOR exists
                                        (a test holds a replica group there while it restarts a peer)
    TITAN_FAULT_START_WHEN=path         before the first step, wait until the file `path` exists (a test starts
                                        replica groups together once each one's manager is up)
    TITAN_FAULT_NO_HEAL=1               fault tolerance without live recovery: a group that rejoins behind its
                                        peers trains on from its own state (shows what the recovery is for)

Kills, signals and hangs fire in the first attempt of a job only (TORCHELASTIC_RESTART_COUNT unset or 0), so that
a run restarted by torchrun --max-restarts shows the recovery instead of failing again. A NaN fires in every attempt,
like a bad batch that is bad each time it is read.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ENV_PREFIX = "TITAN_FAULT_"
_KINDS = ("NAN", "KILL", "SIGNAL", "HANG", "KILL_IN_SAVE", "OSERROR")


def _step_from_env(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"{name}={value!r} is not a step number (>= 1)")
    return int(value or 0)


@dataclass
class Faults:
    """The faults this process injects: the step of each kind (0 = none)."""

    nan_at: int = 0
    kill_at: int = 0
    signal_at: int = 0
    hang_at: int = 0
    kill_in_save_at: int = 0
    wait_at: int = 0
    wait_for: str = ""
    no_heal: bool = False
    start_when: str = ""
    oserror_at: int = 0

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] = os.environ) -> Faults:
        """The faults `env` asks of this rank in this attempt (only the NaN in a restarted attempt)."""
        steps = {kind: _step_from_env(env, f"{ENV_PREFIX}{kind}_AT_STEP") for kind in _KINDS}
        target = env.get(f"{ENV_PREFIX}RANK", "").strip()
        if target and int(target) != rank:
            return cls()
        no_heal = env.get(f"{ENV_PREFIX}NO_HEAL", "") == "1"
        if env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() not in ("", "0"):
            return cls(nan_at=steps["NAN"], no_heal=no_heal)
        return cls(steps["NAN"], steps["KILL"], steps["SIGNAL"], steps["HANG"], steps["KILL_IN_SAVE"],
                   _step_from_env(env, f"{ENV_PREFIX}WAIT_AT_STEP"), env.get(f"{ENV_PREFIX}WAIT_FOR", ""), no_heal,
                   env.get(f"{ENV_PREFIX}START_WHEN", ""), steps["OSERROR"])

    def install(self, trainer: Any) -> None:
        """Hook the faults into `trainer` (a titan_npu Trainer, before train())."""
        trainer.step_start_callbacks.append(self.at_step_start)
        trainer.loss_hooks.append(self.corrupt_loss)
        trainer.reliability.save_hooks.append(self.in_save)
        if self.no_heal and trainer.replicas is not None:
            manager = trainer.replicas.manager
            start_quorum = manager.start_quorum
            manager.start_quorum = lambda **kw: start_quorum(**{**kw, "allow_heal": False})
        _wait_for_file(self.start_when)

    def at_step_start(self, step: int) -> None:
        """Kill, signal or hang this process if asked to at `step`."""
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.hang_at:
            time.sleep(3600)
        if step == self.wait_at:
            _wait_for_file(self.wait_for)
        if step == self.oserror_at:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/shards/shard_00003.bin")

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, or NaN with the same graph at the step asked for (its gradients become NaN too)."""
        return loss * float("nan") if step == self.nan_at else loss

    def in_save(self, step: int) -> None:
        """Called while the checkpoint of `step` is being written."""
        if self.kill_in_save_at and step == self.kill_in_save_at:
            os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_file(path: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def train_with_faults(argv: list[str], faults: Faults) -> int:
    """`titan-npu train ARGV` in this process with `faults` installed; the exit code the command line would give."""
    from titan_npu.cli import run_command
    from titan_npu.train import main

    return run_command(lambda args: main(args, setup=faults.install), argv)

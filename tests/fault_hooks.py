"""Fault injection for the tests: hooks installed on a Trainer that make the run fail on purpose at a chosen step.

Imported as `fault_hooks` (tests/ is on sys.path, as for tiny_run). A subprocess run reads the faults from these
environment variables through tests/train_with_faults.py:

    TITAN_FAULT_NAN_AT_STEP=k           the loss of step k becomes NaN (so do its gradients)
    TITAN_FAULT_KILL_AT_STEP=k          SIGKILL at the start of step k
    TITAN_FAULT_SIGNAL_AT_STEP=k        SIGTERM to itself at the start of step k (the preemption path)
    TITAN_FAULT_HANG_AT_STEP=k          stop answering at the start of step k (sleep for an hour)
    TITAN_FAULT_KILL_IN_SAVE_AT_STEP=k  SIGKILL while step k's checkpoint is being written
    TITAN_FAULT_RANK=r                  only rank r misbehaves (default: every rank)

Kills, signals and hangs fire in the first attempt of a job only (TORCHELASTIC_RESTART_COUNT unset or 0), so that
a run restarted by torchrun --max-restarts shows the recovery instead of failing again. A NaN fires in every attempt,
like a bad batch that is bad each time it is read.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ENV_PREFIX = "TITAN_FAULT_"
_KINDS = ("NAN", "KILL", "SIGNAL", "HANG", "KILL_IN_SAVE")


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

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] = os.environ) -> Faults:
        """The faults `env` asks of this rank in this attempt (only the NaN in a restarted attempt)."""
        steps = {kind: _step_from_env(env, f"{ENV_PREFIX}{kind}_AT_STEP") for kind in _KINDS}
        target = env.get(f"{ENV_PREFIX}RANK", "").strip()
        if target and int(target) != rank:
            return cls()
        if env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() not in ("", "0"):
            return cls(nan_at=steps["NAN"])
        return cls(steps["NAN"], steps["KILL"], steps["SIGNAL"], steps["HANG"], steps["KILL_IN_SAVE"])

    def install(self, trainer: Any) -> None:
        """Hook the faults into `trainer` (a titan_npu Trainer, before train())."""
        trainer.step_start_callbacks.append(self.at_step_start)
        trainer.loss_hooks.append(self.corrupt_loss)
        trainer.reliability.save_hooks.append(self.in_save)

    def at_step_start(self, step: int) -> None:
        """Kill, signal or hang this process if asked to at `step`."""
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.hang_at:
            time.sleep(3600)

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, or NaN with the same graph at the step asked for (its gradients become NaN too)."""
        return loss * float("nan") if step == self.nan_at else loss

    def in_save(self, step: int) -> None:
        """Called while the checkpoint of `step` is being written."""
        if step == self.kill_in_save_at:
            os.kill(os.getpid(), signal.SIGKILL)


def train_with_faults(argv: list[str], faults: Faults) -> int:
    """`titan-npu train ARGV` in this process with `faults` installed; the exit code the command line would give."""
    from titan_npu.cli import run_command
    from titan_npu.train import main

    return run_command(lambda args: main(args, setup=faults.install), argv)

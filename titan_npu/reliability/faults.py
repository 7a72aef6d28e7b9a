"""Fault injection for tests only: environment variables that make a run fail on purpose at a chosen step.

    TITAN_FAULT_NAN_AT_STEP=k           the loss of step k becomes NaN (so do its gradients)
    TITAN_FAULT_KILL_AT_STEP=k          SIGKILL at the start of step k
    TITAN_FAULT_SIGNAL_AT_STEP=k        SIGTERM to itself at the start of step k (the preemption path)
    TITAN_FAULT_HANG_AT_STEP=k          stop answering at the start of step k (sleep for an hour)
    TITAN_FAULT_KILL_IN_SAVE_AT_STEP=k  SIGKILL while step k's checkpoint is being written
    TITAN_FAULT_RANK=r                  only rank r misbehaves (default: every rank)

Kills, signals and hangs fire in the first attempt of a job only (TORCHELASTIC_RESTART_COUNT unset or 0), so that
a run restarted by torchrun --max-restarts shows the recovery instead of failing again. A NaN fires in every attempt,
like a bad batch that is bad each time it is read. Never set these in a real run.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import torch

from titan_npu.errors import ConfigError

log = logging.getLogger("titan_npu")

ENV_PREFIX = "TITAN_FAULT_"
_KINDS = ("NAN", "KILL", "SIGNAL", "HANG", "KILL_IN_SAVE")


def _step_from_env(name: str) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value!r} is not a step number (>= 1); unset it (fault injection is for tests)")
    return int(value)


@dataclass
class Faults:
    """The faults this process injects: the step of each kind (0 = none)."""

    nan_at: int = 0
    kill_at: int = 0
    signal_at: int = 0
    hang_at: int = 0
    kill_in_save_at: int = 0

    @classmethod
    def from_env(cls, rank: int) -> Faults:
        """The faults the environment asks of this rank in this attempt (only the NaN in a restarted attempt)."""
        steps = {kind: _step_from_env(f"{ENV_PREFIX}{kind}_AT_STEP") for kind in _KINDS}
        target = os.environ.get(f"{ENV_PREFIX}RANK", "").strip()
        if target and not target.isdigit():
            raise ConfigError(f"{ENV_PREFIX}RANK={target!r} is not a rank number; unset it")
        if (target and int(target) != rank) or not any(steps.values()):
            return cls()
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() not in ("", "0"):
            faults = cls(nan_at=steps["NAN"])
        else:
            faults = cls(steps["NAN"], steps["KILL"], steps["SIGNAL"], steps["HANG"], steps["KILL_IN_SAVE"])
        if faults != cls():
            log.warning("rank %d: fault injection is on (%s); this run will fail on purpose", rank, faults)
        return faults

    def at_step_start(self, step: int) -> None:
        """Kill, signal or hang this process if asked to at `step`."""
        if _due(step, self.kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        if _due(step, self.signal_at):
            os.kill(os.getpid(), signal.SIGTERM)
        if _due(step, self.hang_at):
            time.sleep(3600)

    def corrupt_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """The loss, or NaN with the same graph at the step asked for (its gradients become NaN too)."""
        if not _due(step, self.nan_at):
            return loss
        return loss * float("nan")

    def in_save(self, step: int) -> None:
        """Called while the checkpoint of `step` is being written."""
        if _due(step, self.kill_in_save_at):
            os.kill(os.getpid(), signal.SIGKILL)


def _due(step: int, fault_step: int) -> bool:
    return fault_step > 0 and step == fault_step

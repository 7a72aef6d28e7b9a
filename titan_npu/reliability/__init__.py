"""Long runs that come back by themselves: numerics guard, preemption, hang watchdog, disk check."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_npu.reliability.guards import StepGuard, TrainingHalted, Verdict
    from titan_npu.reliability.run import Reliability, prepare_reliability
    from titan_npu.reliability.watchdog import HANG_EXIT_CODE, Watchdog

# Loaded on first use: the signal handler and the watchdog are usable without importing torch.
_EXPORTS = {
    "StepGuard": "titan_npu.reliability.guards",
    "TrainingHalted": "titan_npu.reliability.guards",
    "Verdict": "titan_npu.reliability.guards",
    "Reliability": "titan_npu.reliability.run",
    "prepare_reliability": "titan_npu.reliability.run",
    "HANG_EXIT_CODE": "titan_npu.reliability.watchdog",
    "Watchdog": "titan_npu.reliability.watchdog",
}

__all__ = ["HANG_EXIT_CODE", "Reliability", "StepGuard", "TrainingHalted", "Verdict", "Watchdog", "prepare_reliability"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'titan_npu.reliability' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

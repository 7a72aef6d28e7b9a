"""Long runs that come back by themselves: numerics guard, preemption, hang watchdog, disk check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_npu.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)

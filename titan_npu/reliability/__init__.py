"""Long runs that come back by themselves: numerics guard, preemption, hang watchdog, disk check, fault injection."""

from titan_npu.reliability.guards import StepGuard, TrainingHalted, Verdict
from titan_npu.reliability.run import Reliability, prepare_reliability
from titan_npu.reliability.watchdog import HANG_EXIT_CODE, Watchdog

__all__ = ["HANG_EXIT_CODE", "Reliability", "StepGuard", "TrainingHalted", "Verdict", "Watchdog", "prepare_reliability"]

"""Step metrics: throughput/MFU arithmetic, the step window, health flags, sinks, progress and the run report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_npu.lazy import lazy_exports
from titan_npu.metrics.anomaly import SpikeDetector, health_flags
from titan_npu.metrics.logger import MetricsLogger, format_step_line, format_validation_line
from titan_npu.metrics.progress import Progress
from titan_npu.metrics.throughput import Throughput, flops_per_token, throughput

if TYPE_CHECKING:
    from titan_npu.metrics.meter import StepMeter, Window, perplexity, step_record

# The step window (meter.py) imports torch: it is loaded on first use, so that the console's logging set-up
# (metrics/console.py) runs before the launcher imports torch.
_EXPORTS = dict.fromkeys(("StepMeter", "Window", "perplexity", "step_record"), "titan_npu.metrics.meter")

__all__ = [
    "MetricsLogger",
    "Progress",
    "SpikeDetector",
    "StepMeter",
    "Throughput",
    "Window",
    "flops_per_token",
    "format_step_line",
    "format_validation_line",
    "health_flags",
    "perplexity",
    "step_record",
    "throughput",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)

"""Step metrics: throughput/MFU arithmetic, the step window, health flags, sinks, progress and the run report."""

from titan_npu.metrics.anomaly import SpikeDetector, health_flags
from titan_npu.metrics.logger import MetricsLogger, format_step_line, format_validation_line
from titan_npu.metrics.meter import StepMeter, Window, perplexity, step_record
from titan_npu.metrics.progress import Progress
from titan_npu.metrics.throughput import Throughput, flops_per_token, throughput

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

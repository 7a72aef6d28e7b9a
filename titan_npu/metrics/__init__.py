"""Step metrics: throughput/MFU arithmetic and the sinks they are written to."""

from titan_npu.metrics.logger import MetricsLogger, format_step_line
from titan_npu.metrics.throughput import Throughput, flops_per_token, throughput

__all__ = ["MetricsLogger", "Throughput", "flops_per_token", "format_step_line", "throughput"]

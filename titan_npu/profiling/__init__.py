"""Profiling: a step-window wrapper of torch.profiler / torch_npu.profiler that writes chrome traces."""

from titan_npu.profiling.profiler import Profiler, build_profiler, rank_is_profiled

__all__ = ["Profiler", "build_profiler", "rank_is_profiled"]

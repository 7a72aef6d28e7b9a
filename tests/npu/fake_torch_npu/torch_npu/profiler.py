"""torch_npu.profiler of the fake: the documented API, recording CPU activity through torch.profiler.

tensorboard_trace_handler writes what the real one leaves after its analysis (and records where that ran):
<dir>/<worker>_<pid>_<time>_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json (a chrome trace).
The arguments of the last profile() are kept in `last_profile_kwargs` for tests.
"""

from __future__ import annotations

import enum
import os
import socket
import time

import torch.profiler as _torch_profiler

last_profile_kwargs: dict = {}
# Where each trace analysis ran: "training step" (async_mode=False: the step that closed the window waits for the
# analysis, minutes for a large trace) or "worker" (async_mode=True: a forked pool analyses while training goes on).
analyses: list[str] = []


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerLevel:
    Level_none = "Level_none"
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"


class AiCMetrics:
    AiCoreNone = "AiCoreNone"
    PipeUtilization = "PipeUtilization"
    ArithmeticUtilization = "ArithmeticUtilization"
    Memory = "Memory"


class ExportType:
    Text = "text"
    Db = "db"


class _ExperimentalConfig:
    def __init__(self, profiler_level: str = ProfilerLevel.Level0, aic_metrics: str = AiCMetrics.AiCoreNone,
                 l2_cache: bool = False, data_simplification: bool = True, record_op_args: bool = False,
                 export_type: str = ExportType.Text, **kwargs) -> None:
        if profiler_level not in (ProfilerLevel.Level_none, ProfilerLevel.Level0, ProfilerLevel.Level1,
                                  ProfilerLevel.Level2):
            raise ValueError(f"invalid profiler_level {profiler_level!r}")
        self.profiler_level = profiler_level
        self.aic_metrics = aic_metrics
        self.l2_cache = l2_cache
        self.data_simplification = data_simplification
        self.record_op_args = record_op_args
        self.export_type = export_type


def schedule(wait: int, active: int, warmup: int = 0, repeat: int = 0, skip_first: int = 0):
    return _torch_profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)


def tensorboard_trace_handler(dir_name: str | None = None, worker_name: str | None = None,
                              analyse_flag: bool = True, async_mode: bool = False):
    dir_name = dir_name or "./"

    def handler(prof) -> None:
        if analyse_flag:
            analyses.append("worker" if async_mode else "training step")
        worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        out = os.path.join(dir_name, f"{worker}_{int(time.time() * 1000)}_ascend_pt", "ASCEND_PROFILER_OUTPUT")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, "trace_view.json"))

    return handler


class profile(_torch_profiler.profile):
    """torch_npu.profiler.profile: activities of ProfilerActivity, an _ExperimentalConfig for the NPU side."""

    def __init__(self, *, activities=None, schedule=None, on_trace_ready=None, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, with_flops: bool = False,
                 with_modules: bool = False, experimental_config: _ExperimentalConfig | None = None) -> None:
        activities = list(activities or [ProfilerActivity.CPU, ProfilerActivity.NPU])
        if any(not isinstance(a, ProfilerActivity) for a in activities):
            raise TypeError("torch_npu.profiler.profile: activities must be torch_npu.profiler.ProfilerActivity")
        if experimental_config is not None and not isinstance(experimental_config, _ExperimentalConfig):
            raise TypeError("experimental_config must be torch_npu.profiler._ExperimentalConfig")
        last_profile_kwargs.clear()
        last_profile_kwargs.update(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready,
                                   record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                                   experimental_config=experimental_config)
        super().__init__(activities=[_torch_profiler.ProfilerActivity.CPU], schedule=schedule,
                         on_trace_ready=on_trace_ready, record_shapes=record_shapes, profile_memory=profile_memory,
                         with_stack=with_stack)

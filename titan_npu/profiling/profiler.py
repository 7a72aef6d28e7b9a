"""A step-window profiler: torch_npu.profiler on Ascend, torch.profiler elsewhere, one chrome trace per rank.

The Trainer calls start(step) before its loop, step() after every optimizer step and stop() at the end. Nothing
is recorded outside the window [start_step, start_step + active_steps) (1-based steps) or on ranks not listed in
profiling.ranks, so a run pays for profiling only while it profiles. The step before the window, when there is
one, is a warm-up step: recorded, then discarded, so the window starts with the profiler's own overhead paid.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from titan_npu.config.schema import ProfilingConfig
from titan_npu.errors import ConfigError

log = logging.getLogger("titan_npu")

NPU_PROFILER_LEVELS = ("Level0", "Level1", "Level2")


def rank_is_profiled(ranks: list[int], rank: int) -> bool:
    """profiling.ranks lists the ranks to profile; [] or a -1 in it means every rank."""
    return not ranks or -1 in ranks or rank in ranks


def _npu_level(level: str) -> str:
    for name in NPU_PROFILER_LEVELS:
        if level.strip().lower() == name.lower():
            return name
    raise ConfigError(f"profiling.level={level!r} is unknown (choose {', '.join(NPU_PROFILER_LEVELS)})")


class Profiler:
    """Records steps [start_step, start_step + active_steps) and writes a chrome trace per profiled rank."""

    def __init__(self, cfg: ProfilingConfig, rank: int, device_type: str) -> None:
        if cfg.enable and (cfg.start_step < 1 or cfg.active_steps < 1):
            raise ConfigError(
                f"profiling.start_step={cfg.start_step} / active_steps={cfg.active_steps} must both be >= 1 "
                "(steps are counted from 1)"
            )
        self.cfg = cfg
        self.rank = rank
        self.device_type = device_type
        self.enabled = cfg.enable and rank_is_profiled(cfg.ranks, rank)
        if self.enabled and device_type == "npu":
            _npu_level(cfg.level)  # a bad level is refused at start, not when the window opens hours later
        self.warmup = 1 if cfg.start_step > 1 else 0
        self.last_step = cfg.start_step + cfg.active_steps - 1
        self.trace_path: Path | None = None  # where the trace went (the NPU profiler names its own sub-folder)
        self._prof: Any = None
        self._completed = 0

    @property
    def window_dir(self) -> Path:
        return Path(self.cfg.trace_dir) / f"iteration_{self.cfg.start_step}-{self.last_step}"

    def start(self, completed_steps: int = 0) -> None:
        """Begin counting after `completed_steps` steps (more than 0 on resume)."""
        self._completed = completed_steps
        self._maybe_open()

    def step(self) -> None:
        """Mark the end of one optimizer step."""
        if not self.enabled:
            return
        self._completed += 1
        if self._prof is not None:
            self._prof.step()
            if self._completed >= self.last_step:
                self._close()
        self._maybe_open()

    def stop(self) -> None:
        """End profiling; a window cut short by the end of training still writes what it recorded."""
        if self._prof is not None:
            self._close()

    def __enter__(self) -> Profiler:
        self.start(self._completed)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _maybe_open(self) -> None:
        if not self.enabled or self._prof is not None:
            return
        if self._completed == self.cfg.start_step - 1 - self.warmup:
            self._prof = self._build()
            self._prof.start()
            log.info("profiler: recording steps %d-%d on rank %d", self.cfg.start_step, self.last_step, self.rank)

    def _close(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()

    def _build(self) -> Any:
        cfg = self.cfg
        self.window_dir.mkdir(parents=True, exist_ok=True)
        common = dict(record_shapes=cfg.record_shapes, profile_memory=cfg.profile_memory, with_stack=cfg.with_stack)
        if self.device_type == "npu":
            import torch_npu

            level = _npu_level(cfg.level)
            experimental = torch_npu.profiler._ExperimentalConfig(
                profiler_level=getattr(torch_npu.profiler.ProfilerLevel, level),
                aic_metrics=(torch_npu.profiler.AiCMetrics.AiCoreNone if level == "Level0"
                             else torch_npu.profiler.AiCMetrics.PipeUtilization),
                l2_cache=False,
                data_simplification=False,
            )
            # The NPU handler writes <dir>/<worker>_<pid>_<time>_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json.
            self.trace_path = self.window_dir
            activity = torch_npu.profiler.ProfilerActivity
            return torch_npu.profiler.profile(
                activities=[activity.CPU, activity.NPU],
                schedule=torch_npu.profiler.schedule(wait=0, warmup=self.warmup, active=cfg.active_steps, repeat=1),
                # async_mode: the trace is analysed by a forked worker; the step that closes the window does not
                # wait for it (minutes for a large trace).
                on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(
                    str(self.window_dir), worker_name=f"rank{self.rank}", async_mode=True),
                experimental_config=experimental,
                **common,
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            # A window that starts at step 1 has no step before it to warm up on; that is the user's choice.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=self.warmup, active=cfg.active_steps, repeat=1)
        return torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._export_chrome_trace, **common
        )

    def _export_chrome_trace(self, prof: Any) -> None:
        path = self.window_dir / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        self.trace_path = path
        log.info("profiler: wrote %s (open in https://ui.perfetto.dev or chrome://tracing)", path)


def build_profiler(cfg: ProfilingConfig, rank: int, device_type: str) -> Profiler:
    """The run's profiler (inactive unless profiling.enable and this rank is listed)."""
    return Profiler(cfg, rank, device_type)

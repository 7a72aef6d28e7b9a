"""The step-window profiler: which steps it records, on which ranks, where the chrome trace goes, and that on an
NPU it drives torch_npu.profiler (CPU + NPU activities, the configured level, the tensorboard trace handler)."""

from __future__ import annotations

import json

import pytest
import torch

from titan_npu.config.schema import ProfilingConfig
from titan_npu.errors import ConfigError
from titan_npu.profiling import Profiler, rank_is_profiled


def run_steps(profiler: Profiler, n: int, first: int = 1, stop: bool = True) -> None:
    """n fake training steps, each a labelled matmul, with the Trainer's calls around them."""
    profiler.start(first - 1)
    a = torch.randn(8, 8)
    for step in range(first, first + n):
        with torch.profiler.record_function(f"train_step_{step}"):
            a = (a @ a).tanh()
        profiler.step()
    if stop:
        profiler.stop()


def recorded_steps(trace_file) -> set[int]:
    events = json.loads(trace_file.read_text())["traceEvents"]
    return {int(e["name"].rsplit("_", 1)[1]) for e in events if str(e.get("name", "")).startswith("train_step_")}


def cfg(tmp_path, **kw) -> ProfilingConfig:
    return ProfilingConfig(enable=True, trace_dir=str(tmp_path / "profile"), **kw)


def test_only_the_window_steps_reach_the_chrome_trace(tmp_path):
    profiler = Profiler(cfg(tmp_path, start_step=3, active_steps=2), rank=0, device_type="cpu")
    run_steps(profiler, 6)
    trace = tmp_path / "profile" / "iteration_3-4" / "rank0_trace.json"
    assert profiler.trace_path == trace
    assert recorded_steps(trace) == {3, 4}  # step 2 was the discarded warm-up, step 5 came after the window


def test_a_window_from_the_first_step_has_no_warm_up(tmp_path):
    profiler = Profiler(cfg(tmp_path, start_step=1, active_steps=1), rank=0, device_type="cpu")
    run_steps(profiler, 3)
    assert recorded_steps(profiler.trace_path) == {1}


def test_training_that_ends_inside_the_window_still_writes_its_trace(tmp_path):
    profiler = Profiler(cfg(tmp_path, start_step=2, active_steps=5), rank=0, device_type="cpu")
    run_steps(profiler, 3)
    assert recorded_steps(profiler.trace_path) == {2, 3}


def test_a_run_resumed_past_the_window_records_nothing(tmp_path):
    profiler = Profiler(cfg(tmp_path, start_step=2, active_steps=2), rank=0, device_type="cpu")
    run_steps(profiler, 3, first=11)
    assert profiler.trace_path is None and not (tmp_path / "profile").exists()


def test_only_the_listed_ranks_profile(tmp_path):
    assert rank_is_profiled([0], 0) and not rank_is_profiled([0], 1)
    assert rank_is_profiled([], 5) and rank_is_profiled([-1], 5) and rank_is_profiled([1, 3], 3)
    profiler = Profiler(cfg(tmp_path, start_step=1, active_steps=1, ranks=[0]), rank=1, device_type="cpu")
    run_steps(profiler, 2)
    assert profiler.trace_path is None


def test_disabled_profiling_does_nothing(tmp_path):
    profiler = Profiler(ProfilingConfig(enable=False, start_step=1, trace_dir=str(tmp_path / "p")), 0, "cpu")
    run_steps(profiler, 2)
    assert profiler.trace_path is None and not (tmp_path / "p").exists()


def test_a_bad_window_or_level_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="must both be >= 1"):
        Profiler(cfg(tmp_path, start_step=0), 0, "cpu")
    with pytest.raises(ConfigError, match="profiling.level='Level7'"):
        Profiler(cfg(tmp_path, level="Level7"), 0, "npu")


def test_on_the_npu_torch_npu_profiler_records_cpu_and_npu_at_the_configured_level(fake_torch_npu, tmp_path):
    profiler = Profiler(cfg(tmp_path, start_step=2, active_steps=1, level="level2", with_stack=True), 0, "npu")
    run_steps(profiler, 3)
    kwargs = fake_torch_npu.profiler.last_profile_kwargs
    activities = fake_torch_npu.profiler.ProfilerActivity
    assert kwargs["activities"] == [activities.CPU, activities.NPU]
    assert kwargs["experimental_config"].profiler_level == fake_torch_npu.profiler.ProfilerLevel.Level2
    assert kwargs["record_shapes"] and kwargs["profile_memory"] and kwargs["with_stack"]
    traces = list((tmp_path / "profile" / "iteration_2-2").glob("rank0_*_ascend_pt/ASCEND_PROFILER_OUTPUT/"
                                                                 "trace_view.json"))
    assert len(traces) == 1 and recorded_steps(traces[0]) == {2}


def test_the_npu_trace_analysis_runs_off_the_training_path(fake_torch_npu, tmp_path):
    fake_torch_npu.profiler.analyses.clear()
    run_steps(Profiler(cfg(tmp_path, start_step=2, active_steps=1), 0, "npu"), 3)
    assert fake_torch_npu.profiler.analyses == ["worker"]

"""The numerics guard: which updates are skipped, how skips are counted, when the run stops, what a checkpoint keeps."""

from __future__ import annotations

import math

import pytest

from titan_npu.config.schema import JobConfig
from titan_npu.config.validate import validate
from titan_npu.errors import ConfigError
from titan_npu.reliability.guards import MIN_SPIKE_HISTORY, StepGuard

NAN, INF = math.nan, math.inf


def test_a_finite_step_is_applied_and_resets_the_run_of_skips():
    guard = StepGuard(max_skipped_steps=3)
    assert not guard.decide(1, [2.0, NAN], 1.0).apply
    assert guard.decide(2, [2.0, 2.1], 1.0).apply
    assert (guard.consecutive, guard.total, guard.last_applied_step) == (0, 1, 2)


def test_a_nan_loss_on_one_rank_skips_the_step_and_names_that_rank():
    verdict = StepGuard().decide(5, [2.0, NAN, 2.0], 1.0)
    assert not verdict.apply and verdict.reason == "non-finite loss on rank 1"


def test_a_non_finite_grad_norm_skips_the_step_unless_a_loss_scaler_handles_overflow():
    assert StepGuard().decide(1, [2.0], INF).reason == "non-finite grad_norm=inf"
    scaled = StepGuard(scaler_handles_overflow=True)
    assert scaled.decide(1, [2.0], INF).apply and scaled.total == 0  # fp16 overflow is not a failure
    assert not scaled.decide(2, [NAN], NAN).apply  # a NaN loss still is


def test_with_skipping_off_every_step_is_applied():
    guard = StepGuard(skip_nonfinite=False)
    assert not guard.active
    assert guard.decide(1, [NAN], NAN).apply


def test_max_consecutive_skips_sets_the_halt_message_with_the_step_range():
    guard = StepGuard(max_skipped_steps=3)
    guard.decide(1, [2.0], 1.0)
    for step in (2, 3):
        guard.decide(step, [NAN], NAN)
        assert not guard.halt_message
    guard.decide(4, [NAN], NAN)
    assert guard.halt_message.startswith("steps 2-4: 3 updates in a row were skipped")
    assert "reliability.max_skipped_steps=3" in guard.halt_message
    assert guard.last_applied_step == 1
    assert guard.consecutive == 0 and guard.total == 3  # what the halting checkpoint keeps: a fresh budget


def _steady(guard: StepGuard, n: int, start: int = 1) -> int:
    for i in range(n):
        assert guard.decide(start + i, [3.0 + 0.01 * (i % 5)], 1.0).apply
    return start + n


def test_spike_policy_skips_a_loss_far_above_the_recent_window():
    guard = StepGuard(spike_sigma=6.0, spike_window=50)
    step = _steady(guard, MIN_SPIKE_HISTORY)
    verdict = guard.decide(step, [4.0], 1.0)
    assert not verdict.apply and verdict.reason.startswith("loss spike 4.0000")
    assert guard.decide(step + 1, [3.02], 1.0).apply


def test_spike_policy_waits_for_enough_history_and_adapts_to_a_lasting_shift():
    guard = StepGuard(spike_sigma=6.0, spike_window=30, max_skipped_steps=100)
    step = _steady(guard, MIN_SPIKE_HISTORY - 1)
    assert guard.decide(step, [10.0], 1.0).apply  # too little history to call anything a spike
    guard = StepGuard(spike_sigma=6.0, spike_window=30, max_skipped_steps=100)
    step = _steady(guard, 25)
    applied = [guard.decide(step + i, [4.0], 1.0).apply for i in range(30)]
    assert not applied[0] and applied[-1]  # the new level becomes normal once it fills the window


def test_spike_policy_is_off_by_default():
    guard = StepGuard()
    _steady(guard, 30)
    assert guard.decide(31, [100.0], 1.0).apply


def test_state_round_trips_counters_and_window():
    guard = StepGuard(spike_sigma=6.0, spike_window=40)
    step = _steady(guard, 25)
    guard.decide(step, [NAN], NAN)
    restored = StepGuard(spike_sigma=6.0, spike_window=40)
    restored.load_state_dict(guard.state_dict())
    assert (restored.consecutive, restored.total, restored.last_applied_step, restored.first_skipped_step) == (
        1, 1, step - 1, step)
    assert list(restored.window) == list(guard.window)
    # Same history, same decisions.
    assert [restored.decide(50 + i, [x], 1.0).apply for i, x in enumerate((3.0, 5.0, 3.01))] == [
        guard.decide(50 + i, [x], 1.0).apply for i, x in enumerate((3.0, 5.0, 3.01))]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("max_skipped_steps", 0, r"reliability.max_skipped_steps = 0 must be >= 1"),
    ("spike_skip_sigma", -1.0, r"reliability.spike_skip_sigma = -1.0 must be >= 0"),
    ("watchdog_timeout_s", -5.0, r"reliability.watchdog_timeout_s = -5.0 must be >= 0"),
    ("watchdog_step_factor", 1.5, r"reliability.watchdog_step_factor = 1.5 must be 0 \(off\) or >= 2"),
    ("flight_recorder_size", -1, r"reliability.flight_recorder_size = -1 must be >= 0"),
    ("disk_margin", 0.5, r"reliability.disk_margin = 0.5 must be >= 1"),
])
def test_unusable_reliability_settings_are_refused_with_the_key_and_a_usable_value(key, value, message):
    cfg = JobConfig()
    setattr(cfg.reliability, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)

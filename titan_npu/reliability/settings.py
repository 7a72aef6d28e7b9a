"""Checks of the [reliability] section, each message naming the key and a sensible value."""

from __future__ import annotations

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError


def check_reliability_config(cfg: JobConfig) -> None:
    """Raise ConfigError for a [reliability] value no run can use."""
    r = cfg.reliability
    if r.max_skipped_steps < 1:
        raise ConfigError(
            f"reliability.max_skipped_steps = {r.max_skipped_steps} must be >= 1 (consecutive skipped updates "
            "before the run stops; 10 is usual, or set reliability.skip_nonfinite = false to turn skipping off)"
        )
    if r.spike_skip_sigma < 0:
        raise ConfigError(
            f"reliability.spike_skip_sigma = {r.spike_skip_sigma} must be >= 0 (0 = off; 6 skips only clear spikes)"
        )
    if r.watchdog_timeout_s < 0:
        raise ConfigError(
            f"reliability.watchdog_timeout_s = {r.watchdog_timeout_s} must be >= 0 (0 = comm.timeout_s; "
            "set reliability.watchdog = false to turn the watchdog off)"
        )
    if r.watchdog_step_factor != 0 and r.watchdog_step_factor < 2:
        raise ConfigError(
            f"reliability.watchdog_step_factor = {r.watchdog_step_factor} must be 0 (off) or >= 2 (a step this many "
            "times slower than the median counts as hung; 20 is a safe choice)"
        )
    if r.flight_recorder_size < 0:
        raise ConfigError(
            f"reliability.flight_recorder_size = {r.flight_recorder_size} must be >= 0 (0 = off; 2000 is usual)"
        )
    if r.disk_margin < 1:
        raise ConfigError(
            f"reliability.disk_margin = {r.disk_margin} must be >= 1 (free space needed as a multiple of one "
            "checkpoint's size; 1.1 is usual)"
        )

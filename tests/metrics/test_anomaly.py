"""Loss spikes and non-finite values become flags on the step line."""

import math
import random

import pytest

from titan_npu.errors import ConfigError
from titan_npu.metrics import SpikeDetector, health_flags


def noisy_losses(n: int, level: float = 3.0, noise: float = 0.02, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level + rng.gauss(0.0, noise) for _ in range(n)]


def test_a_jump_of_many_sigma_is_flagged_at_its_step():
    det = SpikeDetector(sigma=4.0, window=50, min_history=20)
    assert det.update(1, noisy_losses(40)) == []
    spikes = det.update(41, [3.0, 3.6, 3.0])
    assert [s for s, _ in spikes] == [42]
    assert spikes[0][1] > 10


def test_ordinary_noise_is_not_flagged():
    det = SpikeDetector(sigma=4.0, window=100, min_history=20)
    assert det.update(1, noisy_losses(500, seed=1)) == []


def test_no_flag_before_enough_history():
    det = SpikeDetector(sigma=4.0, window=50, min_history=20)
    assert det.update(1, [3.0] * 5 + [9.0]) == []


def test_a_flat_curve_does_not_flag_tiny_wiggles():
    det = SpikeDetector(sigma=4.0, window=50, min_history=10)
    det.update(1, [2.0] * 30)
    assert det.update(31, [2.02]) == []  # 1% above a flat 2.0: within the 0.5% x |mean| floor times 4 sigma
    assert det.update(32, [2.2]) != []


def test_health_flags_name_nonfinite_losses_grad_norm_and_spikes():
    det = SpikeDetector(sigma=4.0, window=50, min_history=10)
    det.update(1, noisy_losses(30))
    flags = health_flags(31, [3.0, float("nan"), 5.0, float("inf")], float("nan"), det)
    assert flags[0] == "nonfinite_loss step=32,34"
    assert flags[1] == "nonfinite_grad_norm nan"
    assert flags[2].startswith("loss_spike step=33 z=")


def test_healthy_window_has_no_flags():
    det = SpikeDetector()
    assert health_flags(1, noisy_losses(10), 1.0, det) == []


def test_many_nonfinite_steps_are_abbreviated():
    flags = health_flags(10, [math.nan] * 6, 1.0, None)
    assert flags == ["nonfinite_loss step=10,11,12,... (6 steps)"]


@pytest.mark.parametrize("kwargs", [{"sigma": 0.0}, {"window": 1}])
def test_bad_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        SpikeDetector(**kwargs)

import pytest

from titan_npu.config.schema import LRSchedulerConfig
from titan_npu.trainer.optimizer import lr_lambda


def test_warmup_is_linear_and_reaches_peak():
    cfg = LRSchedulerConfig(warmup_steps=9, decay_type="constant")
    assert lr_lambda(0, cfg, 100) == pytest.approx(0.1)
    assert lr_lambda(4, cfg, 100) == pytest.approx(0.5)
    assert lr_lambda(9, cfg, 100) == 1.0
    assert lr_lambda(99, cfg, 100) == 1.0


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_ends_at_min_lr_ratio(decay):
    cfg = LRSchedulerConfig(warmup_steps=10, decay_type=decay, min_lr_ratio=0.1)
    assert lr_lambda(10, cfg, 110) == pytest.approx(1.0)
    assert lr_lambda(60, cfg, 110) == pytest.approx(0.55)  # halfway, both curves cross the midpoint
    assert lr_lambda(110, cfg, 110) == pytest.approx(0.1)


def test_wsd_holds_then_decays_over_the_last_fraction():
    cfg = LRSchedulerConfig(warmup_steps=0, decay_type="wsd", min_lr_ratio=0.0, decay_ratio=0.2)
    assert lr_lambda(79, cfg, 100) == 1.0
    assert lr_lambda(90, cfg, 100) == pytest.approx(0.5)
    assert lr_lambda(100, cfg, 100) == pytest.approx(0.0)

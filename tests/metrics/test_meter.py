"""The step window: tokens/s, TFLOPs and MFU from a fake clock and a known FLOP count."""

import pytest
import torch

from titan_npu.device import MemoryStats
from titan_npu.metrics import StepMeter, flops_per_token, perplexity, step_record


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_meter(clock: FakeClock, world_size: int = 4) -> StepMeter:
    # 4 devices, 4096 tokens per optimizer step (all devices), 1e9 FLOPs per token, 1e12 FLOP/s peak per device.
    return StepMeter(tokens_per_step=4096, world_size=world_size, flops_per_token=1e9, peak_flops=1e12, clock=clock)


def test_window_throughput_and_mfu_from_fake_clock():
    clock = FakeClock()
    meter = make_meter(clock)
    meter.start()
    for _ in range(10):
        clock.now += 0.5
        meter.step(torch.tensor(2.0), data_seconds=0.1)
    w = meter.window()
    tp = meter.throughput(w)
    assert (w.first_step, w.steps, w.seconds) == (1, 10, pytest.approx(5.0))
    assert w.data_seconds == pytest.approx(1.0)
    assert tp.tokens_per_s == pytest.approx(40960 / 5.0)  # 8192 tokens/s for all 4 devices
    assert tp.tokens_per_s_per_device == pytest.approx(2048)
    assert tp.tflops_per_device == pytest.approx(2048 * 1e9 / 1e12)
    assert tp.mfu == pytest.approx(2048 * 1e9 / 1e12)  # 2.048 TFLOP/s of a 1 TFLOP/s peak would be 204.8%


def test_windows_are_contiguous_so_logging_time_is_counted():
    clock = FakeClock()
    meter = make_meter(clock)
    meter.start()
    clock.now += 1.0
    meter.step(1.0, 0.0)
    meter.window()
    clock.now += 0.25  # time spent writing the log line belongs to the next window
    clock.now += 1.0
    meter.step(1.0, 0.0)
    w = meter.window()
    assert w.first_step == 2
    assert w.seconds == pytest.approx(1.25)


def test_excluded_time_is_not_training_time():
    clock = FakeClock()
    meter = make_meter(clock)
    meter.start(next_step=41)
    clock.now += 2.0
    meter.step(1.0, 0.0)
    with meter.excluded():  # e.g. validation
        clock.now += 30.0
    clock.now += 2.0
    meter.step(1.0, 0.0)
    w = meter.window()
    assert (w.first_step, w.steps, w.seconds) == (41, 2, pytest.approx(4.0))


def test_per_step_losses_are_kept_in_order():
    clock = FakeClock()
    meter = make_meter(clock)
    meter.start()
    for x in (3.0, float("nan"), 2.5):
        meter.step(torch.tensor(x), 0.0)
    losses = meter.window().losses
    assert losses[0] == 3.0 and losses[2] == 2.5 and losses[1] != losses[1]


def test_window_before_start_is_an_error():
    with pytest.raises(RuntimeError):
        make_meter(FakeClock()).window()


def test_step_record_has_the_metrics_jsonl_keys():
    clock = FakeClock()
    meter = make_meter(clock, world_size=2)
    meter.start()
    clock.now += 2.0
    meter.step(torch.tensor(1.5), 0.5)
    meter.step(torch.tensor(1.5), 0.5)
    w = meter.window()
    rec = step_record(2, 1.5, 3e-4, 0.9, meter.throughput(w), w, MemoryStats(1.0, 2.0, 64.0), tokens_seen=8192)
    design_keys = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
                   "mfu", "mem_used_gb", "mem_total_gb", "step_time_s", "data_time_s"]
    assert [k for k in rec if k in design_keys] == design_keys
    assert rec["step_time_s"] == pytest.approx(1.0) and rec["data_time_s"] == pytest.approx(0.5)
    assert rec["mem_peak_gb"] == 2.0 and rec["tokens_seen"] == 8192 and rec["window_steps"] == 2


def test_flops_per_token_of_a_llama_shape():
    # Llama 2 7B: 6.61e9 non-embedding params (output projection included), 32 layers, dim 4096, seq 4096.
    from titan_npu.config.schema import ModelConfig
    from titan_npu.models.registry import build_model_args

    args = build_model_args(ModelConfig(name="llama2", flavor="7B"))
    n = args.num_params(exclude_embedding=True)
    assert n == 6_607_343_616
    assert flops_per_token(n, 32, 4096, 4096) == 4.6086512640e10 == args.num_flops_per_token(4096)


def test_perplexity_is_exp_of_loss_and_saturates():
    assert perplexity(2.0) == pytest.approx(7.389056, rel=1e-6)
    assert perplexity(1e6) == float("inf")

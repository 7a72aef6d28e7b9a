import pytest

from titan_npu.metrics import flops_per_token, format_step_line, throughput


def test_flops_per_token_is_six_n_plus_attention_term():
    assert flops_per_token(1_000_000, n_layers=2, dim=64, seq_len=128) == 6e6 + 12 * 2 * 64 * 128


def test_throughput_and_mfu_from_a_known_clock_and_flop_count():
    # 8 devices process 80,000 tokens in 2 s; each token costs 1e9 FLOPs; each device peaks at 1e13 FLOP/s.
    tp = throughput(tokens=80_000, seconds=2.0, world_size=8, flops_per_tok=1e9, peak_flops=1e13)
    assert tp.tokens_per_s == pytest.approx(40_000)
    assert tp.tokens_per_s_per_device == pytest.approx(5_000)
    assert tp.tflops_per_device == pytest.approx(5.0)
    assert tp.mfu == pytest.approx(0.5)


def test_step_line_has_the_design_fields_in_order():
    line = format_step_line({
        "step": 100, "loss": 7.12034, "lr": 2.7e-4, "grad_norm": 1.2344, "tokens_per_s": 980.4, "mfu": 0.412,
        "mem_used_gb": 42.1, "mem_total_gb": 64.0, "step_time_s": 1.234,
    })
    assert line == ("[Step 100] loss=7.1203, lr=2.70e-04, grad_norm=1.234, throughput=980 tokens/s, mfu=41.2%, "
                    "mem=42.1GB/64.0GB, step_time=1.23s")

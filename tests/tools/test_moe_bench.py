"""benchmarks/moe_bench.py compares what docs/performance.md says it compares, and its layer part runs."""

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("moe_bench", ROOT / "benchmarks" / "moe_bench.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_dense_model_has_debug_moes_active_parameters_but_the_router_and_the_trainers_optimizer(bench):
    moe, params, active = bench.build_step([], torch.device("cpu"))
    dense, dense_params, dense_active = bench.build_step(bench.DENSE_OVERRIDES, torch.device("cpu"))
    assert active < params and dense_active == dense_params
    n_layers, n_experts, dim = 4, 8, 128  # configs/debug_moe.toml: one router gate [n_experts, dim] per layer
    assert active - dense_params == n_layers * n_experts * dim
    assert moe.tokens_per_step == dense.tokens_per_step == 2048
    assert all(group["fused"] for loop in (moe, dense) for group in loop.optimizer.param_groups)


def test_the_layer_part_times_the_grouped_gemm_the_loop_and_the_padded_fallback(bench):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--json", "--part", "layer", "--repeats", "1", "--steps", "1", "--tokens", "64"]) == 0
    layer = json.loads(out.getvalue())["layer"]
    assert set(layer["candidates"]) == {"grouped", "loop", "padded"}
    assert all(row["median_s"] > 0 for row in layer["candidates"].values())

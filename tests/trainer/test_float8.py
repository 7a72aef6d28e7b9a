"""float8 training through torchao: which linears convert, the device gate, the one-line refusals, and a 100-step
loss curve in torchao's emulation that follows the bf16 run's."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_npu.config.loader import load_config
from titan_npu.config.schema import Float8Config, JobConfig
from titan_npu.config.validate import validate
from titan_npu.errors import ConfigError
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel import float8
from titan_npu.parallel.float8 import check_float8_device, convert_to_float8, converts

torchao_float8 = pytest.importorskip("torchao.float8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_run import tiny_args  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _meta_model(config: str, *overrides: str) -> nn.Module:
    cfg = load_config(CONFIGS / config, list(overrides))
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        return spec_of(args).build_model(args)


def _float8_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_small_shape_rule_is_torchaos_auto_filter(recipe):
    sizes = [8, 100, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    auto = torchao_float8._auto_filter_for_recipe(recipe, filter_fqns=["output"])
    cfg = Float8Config(recipe=recipe)
    for n in sizes:
        for k in sizes:
            with torch.device("meta"):
                linear = nn.Linear(k, n)
            for fqn in ("layers.0.attention.wq", "output"):
                assert converts(fqn, n, k, cfg) == auto(linear, fqn), (fqn, n, k)


def test_conversion_skips_the_output_the_router_and_dims_not_multiples_of_16():
    model = _meta_model("debug_deepseek.toml")
    cfg = Float8Config(enable=True, emulate=True, auto_filter_small_kn=False)
    converted = convert_to_float8(model, cfg, dp_mode="none")
    assert set(converted) == _float8_names(model)
    kinds = {name.split(".", 2)[-1] for name in converted}
    # Every projection of the debug model has dims that are multiples of 16; the router and the output stay by name.
    assert kinds == {"attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.wo",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "feed_forward.shared_experts.w1",
                     "feed_forward.shared_experts.w2", "feed_forward.shared_experts.w3"}
    assert type(model.output).__name__ != "Float8Linear"
    unaligned = _meta_model("debug.toml", "--model.dim", "72", "--model.n_heads", "4", "--model.n_kv_heads", "2")
    assert not any(name.endswith(("wq", "wo")) for name in convert_to_float8(unaligned, cfg, dp_mode="none"))


def test_filter_fqns_and_the_small_shape_rule_are_the_users_to_set():
    cfg = Float8Config(enable=True, emulate=True, auto_filter_small_kn=False, filter_fqns=["output", "attention"])
    converted = convert_to_float8(_meta_model("debug.toml"), cfg, dp_mode="none")
    assert converted and all(".feed_forward." in name for name in converted)
    assert convert_to_float8(_meta_model("debug.toml"), Float8Config(enable=True), dp_mode="none") == []
    everything = convert_to_float8(_meta_model("debug.toml"), Float8Config(enable=True, filter_fqns=[],
                                                                           auto_filter_small_kn=False), "none")
    assert "output" in everything


def test_a_converted_model_keeps_its_parameter_names_values_and_dtypes():
    torch.manual_seed(0)
    plain = _meta_model("debug.toml").to_empty(device="cpu")
    with torch.no_grad():
        plain.init_weights(buffer_device=torch.device("cpu"), seed=0)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    convert_to_float8(plain, Float8Config(enable=True, emulate=True, auto_filter_small_kn=False), dp_mode="none")
    after = plain.state_dict()
    assert list(after) == list(before)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize(("device", "capability", "missing"), [
    ("cpu", None, "lacks float8 matmul units"),
    ("cuda", (8, 0), "lacks float8 tensor cores (CUDA sm89 or later, this one is sm80)"),
    ("npu", None, "registers no torch._scaled_mm"),
])
def test_a_device_without_float8_matmuls_is_refused_in_one_line(device, capability, missing):
    with pytest.raises(ConfigError) as e:
        check_float8_device(Float8Config(enable=True), device, capability)
    assert missing in str(e.value) and "float8.emulate = true" in str(e.value) and "\n" not in str(e.value)


def test_float8_capable_devices_and_emulation_pass_the_gate(monkeypatch):
    check_float8_device(Float8Config(enable=True), "cuda", (8, 9))
    check_float8_device(Float8Config(enable=True), "cuda", (9, 0))
    check_float8_device(Float8Config(enable=True, emulate=True), "cpu")
    check_float8_device(Float8Config(enable=False), "cpu")
    monkeypatch.setattr(float8, "_npu_has_scaled_mm", lambda: True)
    check_float8_device(Float8Config(enable=True), "npu", device_name="Ascend950PR")


@pytest.mark.parametrize("name", ["Ascend910B3", "Ascend910_9392", "Ascend910B", ""])
def test_an_npu_without_float8_units_is_refused_though_torch_npu_registers_scaled_mm(monkeypatch, name):
    # torch_npu 2.13 registers torch._scaled_mm for the NPU (npu_native_functions_by_codegen.yaml), but only the
    # 950 family has float8 units: a 910B would fail at the first matmul, so the gate refuses it before the run.
    monkeypatch.setattr(float8, "_npu_has_scaled_mm", lambda: True)
    with pytest.raises(ConfigError, match=r"lacks float8 matmul units \(an Ascend 950 part has them") as e:
        check_float8_device(Float8Config(enable=True), "npu", device_name=name)
    assert "\n" not in str(e.value)


def test_missing_torchao_is_refused_naming_the_install_command(monkeypatch):
    real = importlib.import_module

    def no_torchao(name, *args):
        if name.startswith("torchao"):
            raise ModuleNotFoundError("No module named 'torchao'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_torchao)
    with pytest.raises(ConfigError, match=r"needs torchao.*pip install 'titan-npu\[float8\]'"):
        convert_to_float8(_meta_model("debug.toml"), Float8Config(enable=True, emulate=True), dp_mode="none")


@pytest.mark.parametrize(("overrides", "message"), [
    (["--float8.moe_experts", "true"], r"float8.moe_experts = true converts the MoE experts along with the linears; "
                                       r"set float8.enable = true too$"),
    (["--float8.enable", "true", "--float8.emulate", "true", "--float8.moe_experts", "true"],
     r"float8.moe_recipe = 'rowwise' with float8.emulate = true: torchao has no emulation .* emulate "
     r"float8.moe_recipe = 'mxfp8' instead$"),
    (["--float8.enable", "true", "--float8.moe_experts", "true", "--training.dtype", "fp16"],
     r"torchao's float8 grouped GEMMs take fp32 or bf16 operands; use training.dtype = 'bf16'$"),
    (["--float8.moe_recipe", "blockwise"], r"float8.moe_recipe = 'blockwise' is not a known float8 MoE recipe"),
])
def test_float8_experts_settings_torchao_cannot_run_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=r"^command line: ") as e:
        load_config(CONFIGS / "debug_moe.toml", overrides)
    assert re.search(message, str(e.value)) and "\n" not in str(e.value)


def test_an_unknown_recipe_or_an_empty_filter_name_is_refused():
    with pytest.raises(ConfigError, match=r"float8.recipe = 'blockwise' is not a known float8 recipe"):
        load_config(None, ["--float8.recipe", "blockwise"])
    cfg = JobConfig()
    cfg.float8.filter_fqns = ["output", " "]
    with pytest.raises(ConfigError, match=r"float8.filter_fqns .* holds an empty name"):
        validate(cfg)
    assert load_config(None, ["--float8.recipe", "RowWise"]).float8.recipe == "rowwise"


# The 100-step curve: the tiny run in bf16 at a learning rate (1e-3, 10 warmup steps) whose curve is smooth, so that
# the differences are float8's rounding, not a chaotic run amplifying it. Measured over seeds 1, 2, 3 (tensorwise
# and rowwise): mean |loss difference| per step 0.0038-0.0086, the last 10 steps' mean loss 0.01-0.3% apart.
CURVE = dict(training__max_steps=100, training__seed=1, training__dtype="bf16", optimizer__lr=1e-3,
             lr_scheduler__warmup_steps=10, checkpoint__enable=False)
MEAN_ABS_TOLERANCE = 0.03
LAST_10_RELATIVE_TOLERANCE = 0.02


def _curve(run_dir: Path, **extra: object) -> list[float]:
    from titan_npu.cli import main

    assert main(["train", *tiny_args(run_dir, **CURVE, **extra)]) == 0
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and "step" in r]


def test_an_emulated_float8_run_follows_the_bf16_loss_curve_for_100_steps(tmp_path, one_thread):
    bf16 = _curve(tmp_path / "bf16")
    f8 = _curve(tmp_path / "float8", float8__enable=True, float8__emulate=True, float8__auto_filter_small_kn=False)
    assert len(bf16) == len(f8) == 100
    diffs = [abs(a - b) for a, b in zip(bf16, f8)]
    assert max(diffs) > 0  # float8's rounding did reach the losses
    assert sum(diffs) / len(diffs) < MEAN_ABS_TOLERANCE
    last_bf16, last_f8 = sum(bf16[-10:]) / 10, sum(f8[-10:]) / 10
    assert abs(last_f8 - last_bf16) / last_bf16 < LAST_10_RELATIVE_TOLERANCE
    assert last_f8 < f8[0] - 2  # and the run learned

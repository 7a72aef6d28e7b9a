"""float8 for the MoE routed experts (float8.moe_experts): torchao's grouped GEMM in place of the high-precision one,
checked on the CPU in torchao's MXFP8 emulation. Which experts convert, the device gate, the padding of each expert's
rows to the recipe's block (exact on values MXFP8 represents), MXFP8's distance from the high-precision experts on
random values (small, and not zero), unchanged parameters, and a short MoE training run next to the bf16 one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_npu.config.loader import load_config
from titan_npu.config.schema import Float8Config
from titan_npu.errors import ConfigError
from titan_npu.models.moe.experts import GroupedExperts
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel import float8
from titan_npu.parallel.float8 import (
    check_float8_device,
    convert_experts_to_float8,
    convert_to_float8,
    converts_experts,
    experts_grouped_mm,
    pad_groups,
)

pytest.importorskip("torchao.prototype.moe_training")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_run import tiny_args  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EMULATED = Float8Config(enable=True, emulate=True, moe_experts=True, moe_recipe="mxfp8")
# Token counts per expert: empty experts, groups shorter than MXFP8's block of 32, longer, and not multiples of it.
COUNTS = [5, 0, 37, 12, 3, 0, 60, 1]


def _meta_model(config: str, *overrides: str) -> nn.Module:
    args = build_model_args(load_config(CONFIGS / config, list(overrides)).model)
    with torch.device("meta"):
        return spec_of(args).build_model(args)


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _reference_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group's rows times its weight^T, one plain matmul per group."""
    starts = [0, *offsets.tolist()[:-1]]
    return torch.cat([x[s:e] @ w[g].T for g, (s, e) in enumerate(zip(starts, offsets.tolist()))])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_experts_convert_by_name_and_by_the_recipes_block_and_router_and_shared_experts_follow_the_dense_rules():
    model = _meta_model("debug_deepseek.toml")
    cfg = Float8Config(enable=True, emulate=True, auto_filter_small_kn=False, moe_experts=True, moe_recipe="mxfp8")
    converted = convert_to_float8(model, cfg, dp_mode="none")
    moe_layers = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    assert moe_layers and {n for n in converted if n.endswith(".experts")} == set(moe_layers)
    assert all(model.get_submodule(n).float8_grouped_mm is not None for n in moe_layers)
    # The router stays by name (router.gate), the shared experts are linears under the dense rule: converted here.
    kinds = {name.split(".", 2)[-1] for name in converted}
    assert "feed_forward.router.gate" not in kinds
    assert {"feed_forward.shared_experts.w1", "feed_forward.shared_experts.w2"} <= kinds
    assert all(type(model.get_submodule(f"{n[:-len('experts')]}router.gate")).__name__ != "Float8Linear"
               for n in moe_layers)
    # Named out by filter_fqns; dims not multiples of the recipe's block (mxfp8: 32, rowwise: 16).
    assert not convert_experts_to_float8(_meta_model("debug_moe.toml"),
                                         Float8Config(enable=True, moe_experts=True, filter_fqns=["experts"]))
    assert not converts_experts("layers.0.feed_forward.experts", 128, 48, EMULATED)
    assert converts_experts("layers.0.feed_forward.experts", 128, 48, Float8Config(enable=True, moe_experts=True))
    assert not converts_experts("layers.0.feed_forward.experts", 128, 128, Float8Config(enable=True))
    assert not convert_to_float8(_meta_model("debug_moe.toml"), Float8Config(enable=True), dp_mode="none")


def test_a_converted_moe_model_keeps_its_parameter_names_values_dtypes_and_plain_tensors():
    model = _meta_model("debug_moe.toml", "--model.n_layers", "2").to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_experts_to_float8(model, EMULATED) == ["layers.0.feed_forward.experts",
                                                          "layers.1.feed_forward.experts"]
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(type(after[k]) is torch.Tensor and after[k].dtype == before[k].dtype and torch.equal(after[k], before[k])
               for k in before)


def test_padding_puts_each_group_at_a_multiple_of_the_block_without_reading_the_offsets():
    x = torch.arange(sum(COUNTS), dtype=torch.float32).unsqueeze(1) + 1
    padded, ends, rows = pad_groups(x, _offsets(COUNTS), 32)
    padded_counts = [-(-c // 32) * 32 for c in COUNTS]
    assert ends.tolist() == torch.tensor(padded_counts).cumsum(0).tolist() and ends.dtype == torch.int32
    assert padded.shape[0] % 32 == 0 and padded.shape[0] >= ends[-1]
    assert torch.equal(padded[rows], x) and padded.sum() == x.sum()  # every row once, zeros elsewhere
    starts = [0, *ends.tolist()[:-1]]
    assert all(padded[s:s + c].flatten().tolist() == x[sum(COUNTS[:g]):sum(COUNTS[:g + 1])].flatten().tolist()
               for g, (s, c) in enumerate(zip(starts, COUNTS)))


def _grids(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Tensors of {-1, -0.5, 0, 0.5, 1}: MXFP8 holds them exactly (one power-of-2 scale per 32 values), and their
    products' sums here are exact in bf16."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(-2, 3, shape, generator=gen) * 0.5).requires_grad_() for shape in shapes]


def test_the_float8_grouped_mm_equals_the_grouped_gemm_on_values_mxfp8_holds_for_groups_of_any_size():
    n, k, m = sum(COUNTS), 32, 64
    x, w, grad = _grids((n, k), (len(COUNTS), m, k), (n, m))
    offsets = _offsets(COUNTS)
    out = experts_grouped_mm("mxfp8", emulate=True)(x, w, offsets)
    out.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _reference_grouped_mm(x2, w2, offsets)
    ref.backward(grad)
    assert out.dtype == torch.float32 and out.shape == (n, m)
    assert torch.equal(out, ref) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    # A tensor-parallel slice of the ffn dim off the block (96 / 2 = 48 rows of an mxfp8 expert) is refused.
    with pytest.raises(ConfigError, match=r"this rank's experts are \[8, 48, 32\] .* multiples of 32"):
        experts_grouped_mm("mxfp8", emulate=True)(x, w[:, :48], offsets)


@pytest.mark.parametrize("capacity", [False, True], ids=["dropless", "capacity"])
def test_converted_experts_are_within_mxfp8_rounding_of_the_high_precision_ones_forward_and_backward(capacity):
    # Measured (seed 0, fp32): output, input and weight gradients 6.5-6.7% apart (relative Frobenius norm) dropless,
    # 6.6-6.8% with capacity slots: MXFP8's 3 mantissa bits through three GEMMs and a SwiGLU.
    torch.manual_seed(0)
    experts = GroupedExperts(len(COUNTS), 64, 96)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.05)
    n, offsets = sum(COUNTS), _offsets(COUNTS)
    x, grad = torch.randn(n, 64, requires_grad=True), torch.randn(n, 64)
    slots, slots_grad = torch.randn(len(COUNTS), 20, 64, requires_grad=True), torch.randn(len(COUNTS), 20, 64)

    def run() -> list[torch.Tensor]:
        x.grad = slots.grad = None
        experts.zero_grad()
        if capacity:
            experts.forward_batched(slots).backward(slots_grad)
            return [slots.grad.clone(), experts.w1.grad.clone(), experts.w2.grad.clone()]
        out = experts(x, offsets, max(COUNTS))
        out.backward(grad)
        return [out.detach(), x.grad.clone(), experts.w1.grad.clone(), experts.w2.grad.clone(), experts.w3.grad.clone()]

    reference = run()
    convert_experts_to_float8(experts, EMULATED)
    converted = run()
    distances = [_relative(a, b) for a, b in zip(converted, reference)]
    assert all(0.01 < d < 0.12 for d in distances), distances


@pytest.mark.parametrize(("cfg", "device", "capability", "missing"), [
    (EMULATED.__class__(enable=True, moe_experts=True), "cpu", None, "cpu lacks float8 grouped GEMM units"),
    (EMULATED.__class__(enable=True, moe_experts=True), "cuda", (8, 9),
     "lacks the rowwise grouped GEMM kernels (CUDA sm90 or later, this one is sm89)"),
    (EMULATED.__class__(enable=True, moe_experts=True, moe_recipe="mxfp8"), "cuda", (9, 0),
     "lacks the mxfp8 grouped GEMM kernels (CUDA sm100 or later, this one is sm90)"),
    (EMULATED.__class__(enable=True, moe_experts=True), "npu", None,
     "lacks torchao's float8 grouped GEMM (it quantises with CUDA Triton kernels, and this torch_npu registers no "
     "torch._grouped_mm"),
    (EMULATED, "npu", None, "emulated: npu lacks torch._grouped_mm (this torch_npu registers none for the NPU"),
])
def test_a_device_without_the_recipes_grouped_gemm_is_refused_in_one_line(cfg, device, capability, missing):
    with pytest.raises(ConfigError) as e:
        check_float8_device(cfg, device, capability)
    assert str(e.value).startswith("float8.moe_experts = true") and missing in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_devices_with_the_recipes_grouped_gemm_and_the_emulation_pass_the_gate(monkeypatch):
    rowwise, mxfp8 = Float8Config(enable=True, moe_experts=True), Float8Config(enable=True, moe_experts=True,
                                                                                moe_recipe="mxfp8")
    if hasattr(torch, "_scaled_grouped_mm"):
        check_float8_device(rowwise, "cuda", (9, 0))
    monkeypatch.setattr(float8, "_mxfp8_kernels_available", lambda: True)
    check_float8_device(mxfp8, "cuda", (10, 0))
    monkeypatch.setattr(float8, "_mxfp8_kernels_available", lambda: False)
    with pytest.raises(ConfigError, match="lacks torchao's MXFP8 kernels"):
        check_float8_device(mxfp8, "cuda", (10, 0))
    check_float8_device(EMULATED, "cpu")
    monkeypatch.setattr(float8, "_npu_has_grouped_mm", lambda: True)
    check_float8_device(EMULATED, "npu")


# A short run of a 2-layer Qwen3-MoE (8 experts, top-2) in bf16, then with its experts in emulated MXFP8 (the other
# linears kept in bf16 so the difference is the experts'). Measured (seed 1): mean |loss difference| per step 0.0036,
# at most 0.0076 over 8 steps, losses 7.3 -> 4.8.
MOE_RUN = dict(model__name="qwen3_moe", model__flavor="debug", model__n_experts=8, model__top_k=2, model__head_dim=16,
               model__moe_ffn_dim=64, training__max_steps=8, training__seed=1, training__dtype="bf16",
               checkpoint__enable=False)
EXPERTS_ONLY = dict(float8__enable=True, float8__emulate=True, float8__moe_experts=True, float8__moe_recipe="mxfp8",
                    float8__filter_fqns="[output,router.gate,attention,shared_experts]")
MOE_MEAN_ABS_TOLERANCE = 0.02


def _losses(run_dir: Path, **extra: object) -> list[float]:
    from titan_npu.cli import main

    assert main(["train", *tiny_args(run_dir, **MOE_RUN, **extra)]) == 0
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and "step" in r]


def test_a_moe_run_with_emulated_float8_experts_follows_the_bf16_run(tmp_path, one_thread):
    bf16 = _losses(tmp_path / "bf16")
    f8 = _losses(tmp_path / "float8", **EXPERTS_ONLY)
    assert len(bf16) == len(f8) == MOE_RUN["training__max_steps"]
    diffs = [abs(a - b) for a, b in zip(bf16, f8)]
    assert max(diffs) > 0  # the experts' float8 rounding reached the losses
    assert sum(diffs) / len(diffs) < MOE_MEAN_ABS_TOLERANCE
    assert f8[-1] < f8[0] - 1  # and the run learned

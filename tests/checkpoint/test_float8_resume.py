"""A float8 run's checkpoints are those of a high-precision run: the same keys, shapes and fp32 dtypes, so a float8
run resumes exactly, resumes without float8, a high-precision run resumes in float8, and the HF export is alike; a
MoE run whose experts run in float8 (float8.moe_experts) too."""

from __future__ import annotations

import json

import pytest

from titan_npu.checkpoint.dcp_io import read_metadata

from .runs import copy_checkpoint, losses, overrides, run_here

pytest.importorskip("torchao.float8")

FLOAT8 = dict(float8__enable=True, float8__emulate=True, float8__auto_filter_small_kn=False)
RUN = dict(training__max_steps=4, checkpoint__save_interval=2, checkpoint__async_save=False)


def _layout(step_dir) -> dict[str, tuple]:
    """Every saved tensor's (shape, dtype) by key."""
    entries = read_metadata(step_dir).state_dict_metadata
    return {key: (tuple(e.size), e.properties.dtype) for key, e in entries.items() if hasattr(e, "size")}


def test_float8_run_resumes_exactly_and_resumes_without_float8_and_back(tmp_path):
    run_here(overrides(tmp_path, "float8", **RUN, **FLOAT8))
    full = losses(tmp_path, "float8")

    copy_checkpoint(tmp_path, "float8", 2, "float8_again")
    run_here(overrides(tmp_path, "float8_again", **RUN, **FLOAT8))
    again = losses(tmp_path, "float8_again")
    assert sorted(again) == [3, 4] and [again[s] for s in (3, 4)] == [full[s] for s in (3, 4)]

    copy_checkpoint(tmp_path, "float8", 2, "to_plain")
    trainer = run_here(overrides(tmp_path, "to_plain", **RUN))
    assert not any(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())
    to_plain = losses(tmp_path, "to_plain")
    assert sorted(to_plain) == [3, 4]
    # The same weights and data with high-precision matmuls: close to the float8 run's losses, not equal.
    assert all(0 < abs(to_plain[s] - full[s]) < 0.05 for s in (3, 4))

    copy_checkpoint(tmp_path, "to_plain", 4, "back")
    run_here(overrides(tmp_path, "back", **{**RUN, "training__max_steps": 6}, **FLOAT8))
    assert sorted(losses(tmp_path, "back")) == [5, 6]


def test_float8_checkpoint_and_hf_export_hold_the_high_precision_tensors_of_a_plain_run(tmp_path):
    from safetensors import safe_open

    from titan_npu.cli import main

    trainer = run_here(overrides(tmp_path, "float8", **RUN, **FLOAT8))
    assert sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules()) == 2 * 7  # every linear but output
    run_here(overrides(tmp_path, "plain", **RUN))
    assert _layout(tmp_path / "float8" / "ckpt" / "step-4") == _layout(tmp_path / "plain" / "ckpt" / "step-4")
    exported = {}
    for name in ("float8", "plain"):
        out = tmp_path / f"{name}_hf"
        assert main(["export", "--checkpoint", str(tmp_path / name / "ckpt"), "--format", "hf",
                     "--output", str(out)]) == 0
        tensors = {}
        for file in sorted(out.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                tensors.update({key: (tuple(f.get_tensor(key).shape), f.get_tensor(key).dtype) for key in f.keys()})
        exported[name] = (tensors, json.loads((out / "config.json").read_text()))
    assert exported["float8"] == exported["plain"]


MOE = dict(model__name="qwen3_moe", model__flavor="debug", model__n_experts=4, model__top_k=2, model__head_dim=16,
           model__moe_ffn_dim=64)
MOE_FLOAT8 = dict(float8__enable=True, float8__emulate=True, float8__moe_experts=True, float8__moe_recipe="mxfp8")


def test_a_moe_run_with_float8_experts_saves_the_plain_runs_tensors_and_resumes_without_float8(tmp_path):
    trainer = run_here(overrides(tmp_path, "float8", **RUN, **MOE, **MOE_FLOAT8))
    experts = [m for m in trainer.model.modules() if hasattr(m, "float8_grouped_mm")]
    assert experts and all(m.float8_grouped_mm is not None for m in experts)
    full = losses(tmp_path, "float8")
    run_here(overrides(tmp_path, "plain", **RUN, **MOE))
    assert _layout(tmp_path / "float8" / "ckpt" / "step-4") == _layout(tmp_path / "plain" / "ckpt" / "step-4")

    copy_checkpoint(tmp_path, "float8", 2, "to_plain")
    trainer = run_here(overrides(tmp_path, "to_plain", **RUN, **MOE))
    assert all(m.float8_grouped_mm is None for m in trainer.model.modules() if hasattr(m, "float8_grouped_mm"))
    to_plain = losses(tmp_path, "to_plain")
    assert sorted(to_plain) == [3, 4]
    # The float8 run's weights with high-precision experts: close to its losses, not equal.
    assert all(0 < abs(to_plain[s] - full[s]) < 0.05 for s in (3, 4))

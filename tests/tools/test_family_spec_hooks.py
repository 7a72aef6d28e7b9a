"""Framework code that needs a family-specific fact asks the family's ModelSpec: generate's refusal, the
multi-token-prediction hint of a checkpoint's key check, the planner's block kinds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from titan_npu.checkpoint.fit import likely_cause
from titan_npu.config.schema import ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.models.registry import SPECS, build_model, build_model_args
from titan_npu.tools.generate import CachedLlama


def _args(name: str, **fields):
    """The family's debug args, with `fields` replaced."""
    return replace(build_model_args(ModelConfig(name=name)), **fields)


def test_generate_refuses_in_one_line_what_the_family_says_it_cannot_decode():
    with torch.device("meta"):
        model = build_model(_args("qwen3_next"))
    with pytest.raises(ConfigError, match=r"generate has no cached decoding for qwen3_next") as error:
        CachedLlama(model, max_len=8)
    assert "\n" not in str(error.value)


def test_generate_takes_a_family_that_has_no_refusal():
    assert SPECS["llama3"].generate_refusal(_args("llama3")) is None
    assert CachedLlama(build_model(_args("llama3")), max_len=8).model is not None


def test_a_checkpoint_short_of_the_models_extra_blocks_names_the_key_that_counts_them():
    args = _args("deepseek_v3", mtp_depth=1)
    extra = f"layers.{args.n_layers}.attention.wkv_a.weight"
    cause = likely_cause([extra], [], [], ["layers.0.attention.wkv_a.weight", extra],
                         ["layers.0.attention.wkv_a.weight"], args)
    assert "holds 0 whole multi-token-prediction layer(s)" in cause and "set model.mtp_depth=0" in cause


def test_every_family_gives_one_block_cost_per_layer():
    for name, spec in SPECS.items():
        args = _args(name)
        blocks = spec.block_costs(args)
        assert len(blocks) == args.n_layers, name
        assert all(b.kind == (b.mixer.name, b.ffn.name) for b in blocks), name

"""Resolving [model] into LlamaArgs: flavor presets, overrides, Meta's FFN rule, validation, parameter counts."""

import pytest
import torch

from titan_npu.config.schema import ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.models.llama import FLAVORS, LlamaArgs, Transformer, ffn_hidden_dim
from titan_npu.models.registry import build_model_args


def _args(name="llama3", flavor="debug", **overrides):
    return build_model_args(ModelConfig(name=name, flavor=flavor, **overrides))


# Published parameter counts (Meta / Hugging Face model cards).
@pytest.mark.parametrize(
    "name, flavor, expected",
    [
        ("llama2", "7B", 6.74e9),
        ("llama2", "13B", 13.0e9),
        ("llama2", "70B", 68.98e9),
        ("llama3", "8B", 8.03e9),
        ("llama3", "70B", 70.6e9),
        ("llama3", "405B", 405.9e9),
    ],
)
def test_flavor_parameter_counts_match_published_figures(name, flavor, expected):
    assert abs(_args(name, flavor).num_params() - expected) / expected < 0.005


def test_flavors_resolve_meta_shapes():
    l2 = _args("llama2", "7B")
    shape = (l2.dim, l2.n_layers, l2.n_heads, l2.n_kv_heads, l2.ffn_dim, l2.vocab_size)
    assert shape == (4096, 32, 32, 32, 11008, 32000)
    assert l2.rope_theta == 10000.0
    l3 = _args("llama3", "8B")
    assert (l3.n_kv_heads, l3.ffn_dim, l3.vocab_size, l3.rope_theta) == (8, 14336, 128256, 500000.0)
    assert _args("llama3", "70B").ffn_dim == 28672
    l1 = _args("llama3", "1B")  # Llama 3.2 1B: tied output, RoPE scaled by 32; 1,235,814,400 parameters published
    assert (l1.dim, l1.n_layers, l1.n_heads, l1.n_kv_heads, l1.ffn_dim) == (2048, 16, 32, 8, 8192)
    assert (l1.tie_embeddings, l1.rope_scaling_factor, l1.num_params()) == (True, 32.0, 1_235_814_400)
    l31 = _args("llama3", "3.1-8B")  # 8,030,261,248 published
    assert (l31.rope_scaling_factor, l31.max_seq_len, l31.num_params()) == (8.0, 131072, 8_030_261_248)
    assert _args("llama2", "13B").ffn_dim == 13824


def test_llama3_7b_is_llama2_7b_shapes_with_llama3_vocab_and_rope():
    l3_7b, l2_7b = _args("llama3", "7B"), _args("llama2", "7B")
    shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
    assert [getattr(l3_7b, k) for k in shape] == [getattr(l2_7b, k) for k in shape]
    assert (l3_7b.vocab_size, l3_7b.rope_theta) == (128256, 500000.0)


def test_ffn_hidden_dim_follows_metas_rule():
    assert ffn_hidden_dim(4096, 256, None) == 11008
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert ffn_hidden_dim(8192, 4096, 1.3) == 28672
    assert ffn_hidden_dim(5120, 256, None) == 13824


def test_explicit_fields_override_the_preset_and_the_ffn_is_recomputed_from_them():
    args = _args("llama3", "8B", dim=2048, n_layers=4, vocab_size=1000, rope_theta=1e4, max_seq_len=512)
    assert (args.dim, args.n_layers, args.vocab_size, args.rope_theta, args.max_seq_len) == (2048, 4, 1000, 1e4, 512)
    assert args.n_heads == 32 and args.n_kv_heads == 8
    assert args.ffn_dim == ffn_hidden_dim(2048, 1024, 1.3)
    assert _args("llama3", "8B", multiple_of=256, ffn_dim_multiplier=1.0).ffn_dim == ffn_hidden_dim(4096, 256, 1.0)


def test_explicit_ffn_dim_wins_over_the_rule():
    assert _args("llama3", "8B", ffn_dim=1000, ffn_dim_multiplier=2.0).ffn_dim == 1000


def test_kv_heads_default_to_heads_for_multi_head_flavors():
    args = _args("llama2", "debug", n_heads=8)
    assert args.n_kv_heads == 8
    assert LlamaArgs(dim=64, n_heads=4, ffn_dim=128).n_kv_heads == 4


def test_rope_scaling_zero_means_off():
    assert _args(rope_scaling_factor=0).rope_scaling_factor is None
    assert _args(rope_scaling_factor=8.0).rope_scaling_factor == 8.0


def test_use_flash_attention_is_carried():
    assert _args(use_flash_attention=False).use_flash_attention is False


@pytest.mark.parametrize(
    "name, flavor, family, expected",
    [
        ("llama_7b", "debug", "llama2", "7B"),
        ("llama2_13b", "debug", "llama2", "13B"),
        ("Llama-3-8B", "8B", "llama3", "8B"),
        ("llama3_7b", "debug", "llama3", "7B"),
        ("LLAMA3", "70b", "llama3", "70B"),
    ],
)
def test_names_with_sizes_and_any_case_are_accepted(name, flavor, family, expected):
    args = _args(name, flavor)
    assert (args.family, args.flavor) == (family, expected)


def test_unknown_family_and_flavor_list_the_valid_ones():
    with pytest.raises(ConfigError, match=r"model.name='gpt2'.*llama2, llama3"):
        _args("gpt2")
    with pytest.raises(ConfigError, match=r"model.flavor=.13B. is not a llama3 flavor \(valid: debug, 1B, 3B, 7B"):
        _args("llama3", "13B")


def test_size_in_name_conflicting_with_flavor_is_refused():
    with pytest.raises(ConfigError, match="says 7B but model.flavor='13B'"):
        _args("llama2_7b", "13B")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dim=250), r"model.dim=250 is not divisible by model.n_heads=16 \(use dim 240 or 256"),
        (dict(n_kv_heads=3), r"model.n_heads=16 is not a multiple of model.n_kv_heads=3 \(choose n_kv_heads from"),
        (dict(dim=48, n_heads=16, n_kv_heads=16), r"= 3 is odd; rotary embedding needs an even head_dim"),
        (dict(n_layers=0), r"model.n_layers=0 must be positive"),
        (dict(norm_eps="1e-5"), r"model.norm_eps='1e-5' is not a number"),
        (dict(rope_scaling_factor=-2.0), r"model.rope_scaling_factor=-2.0 must be positive"),
    ],
)
def test_inconsistent_shapes_are_config_errors_with_numbers_and_a_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _args(**overrides)


def test_num_params_equals_the_built_models_parameter_count():
    for args in (_args("llama2", "debug", n_layers=2), _args("llama3", "debug", n_layers=2, vocab_size=300)):
        model = Transformer(args)
        assert args.num_params() == sum(p.numel() for p in model.parameters())
        embedding = model.tok_embeddings.weight.numel()
        assert args.num_params(exclude_embedding=True) == args.num_params() - embedding


def test_num_params_of_every_flavor_shape_equals_the_meta_built_model():
    for family, flavors in FLAVORS.items():
        for flavor in flavors:
            args = _args(family, flavor, n_layers=2)  # every layer has the same shapes; two keep it quick
            with torch.device("meta"):
                model = Transformer(args)
            assert args.num_params() == sum(p.numel() for p in model.parameters()), (family, flavor)


def test_flops_per_token_is_six_n_plus_attention():
    args = _args("llama3", "8B")
    seq = 8192
    expected = 6 * args.num_params(exclude_embedding=True) + 12 * 32 * 32 * 128 * seq
    assert args.num_flops_per_token(seq) == expected

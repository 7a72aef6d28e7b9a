"""Weight and config mapping between our (Meta's) Llama, Hugging Face and Meta's consolidated checkpoints."""

import pytest
import torch

from titan_npu.config.schema import ModelConfig
from titan_npu.errors import CheckpointError
from titan_npu.models.llama import (
    LlamaArgs,
    Transformer,
    args_from_hf_config,
    from_hf,
    from_meta,
    hf_config,
    to_hf,
)
from titan_npu.models.registry import build_model_args

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128, max_seq_len=32,
                 rope_theta=500000.0, family="llama3")


def _state_dict(args=ARGS, seed=0):
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model.state_dict()


def test_to_hf_uses_llama_for_causal_lm_names():
    hf = to_hf(_state_dict(), ARGS)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(hf)
    layer = {k.removeprefix("model.layers.1.") for k in hf if k.startswith("model.layers.1.")}
    assert layer == {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    }
    ours = _state_dict()
    assert torch.equal(hf["model.layers.1.mlp.gate_proj.weight"], ours["layers.1.feed_forward.w1.weight"])
    assert torch.equal(hf["model.layers.1.mlp.up_proj.weight"], ours["layers.1.feed_forward.w3.weight"])
    assert torch.equal(hf["model.layers.1.mlp.down_proj.weight"], ours["layers.1.feed_forward.w2.weight"])


def test_to_hf_then_from_hf_is_the_identity():
    ours = _state_dict()
    back = from_hf(to_hf(ours, ARGS), ARGS)
    assert set(back) == set(ours)
    for key, value in ours.items():
        assert torch.equal(back[key], value), key


def test_rope_permutation_moves_interleaved_pairs_to_halves_per_head():
    args = LlamaArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4, ffn_dim=8)
    # Row r of wq holds the value r, so the permuted row order is visible directly.
    sd = {"layers.0.attention.wq.weight": torch.arange(8.0)[:, None].expand(8, 8).clone(),
          "layers.0.attention.wk.weight": torch.arange(4.0)[:, None].expand(4, 8).clone()}
    hf = to_hf(sd, args)
    assert hf["model.layers.0.self_attn.q_proj.weight"][:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert hf["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == [0, 2, 1, 3]


def test_from_hf_drops_rotary_buffers_and_refuses_foreign_keys():
    hf = to_hf(_state_dict(), ARGS)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert "layers.0.self_attn.rotary_emb.inv_freq" not in from_hf(hf, ARGS)
    hf["model.layers.0.mlp.experts.0.weight"] = torch.ones(2)
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.experts.0.weight' has no counterpart in this model"):
        from_hf(hf, ARGS)


def test_to_hf_refuses_keys_that_are_not_model_weights():
    sd = _state_dict()
    sd["optimizer.step"] = torch.tensor(1)
    with pytest.raises(CheckpointError, match="'optimizer.step' is not a parameter of this model"):
        to_hf(sd, ARGS)


def test_q_k_shapes_that_do_not_fit_the_args_are_checkpoint_errors():
    hf = to_hf(_state_dict(), ARGS)
    wrong = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=96, ffn_dim=128)
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has shape \(32, 64\) but the model expects \(64, 64\)"):
        from_hf(hf, wrong)


def test_tied_hf_embeddings_become_our_untied_output():
    hf = to_hf(_state_dict(), ARGS)
    del hf["lm_head.weight"]
    ours = from_hf(hf, ARGS, tie_word_embeddings=True)
    assert torch.equal(ours["output.weight"], ours["tok_embeddings.weight"])
    assert "output.weight" not in from_hf(hf, ARGS)


def test_hf_config_round_trips_through_transformers_llama_config():
    transformers = pytest.importorskip("transformers")
    for args in (ARGS, build_model_args(ModelConfig(name="llama3", flavor="8B", rope_scaling_factor=8.0)),
                 build_model_args(ModelConfig(name="llama2", flavor="70B"))):
        # What transformers writes to config.json (rope_parameters in v5, rope_scaling in v4) reads back.
        written = transformers.LlamaConfig(**hf_config(args)).to_dict()
        back = args_from_hf_config(written)
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps",
                      "rope_theta", "rope_scaling_factor", "max_seq_len", "family"):
            assert getattr(back, field) == getattr(args, field), field


def test_hf_config_recognises_flavors():
    assert args_from_hf_config(hf_config(build_model_args(ModelConfig(name="llama3", flavor="8B")))).flavor == "8B"
    assert args_from_hf_config(hf_config(build_model_args(ModelConfig(name="llama2", flavor="7B")))).flavor == "7B"
    assert args_from_hf_config(hf_config(ARGS)).flavor == "custom"


def test_hf_config_with_rope_scaling_reads_the_llama31_form():
    config = hf_config(ARGS)
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert args_from_hf_config(config).rope_scaling_factor == 32.0
    assert hf_config(args_from_hf_config(config))["rope_scaling"] == config["rope_scaling"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="mistral"), "model_type='mistral' is not 'llama'"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(head_dim=15), r"head_dim\) = 15 is odd"),
        (dict(use_sliding_window=True), "use_sliding_window=True"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}), "only Llama 3.1's"),
    ],
)
def test_hf_configs_this_model_cannot_represent_are_refused(change, message):
    with pytest.raises(CheckpointError, match=message):
        args_from_hf_config({**hf_config(ARGS), **change})


def test_missing_hf_config_fields_are_named():
    config = hf_config(ARGS)
    del config["intermediate_size"]
    with pytest.raises(CheckpointError, match="lacks intermediate_size"):
        args_from_hf_config(config)


def test_from_meta_keeps_our_names_and_drops_rope_freqs():
    ours = _state_dict()
    meta = {**ours, "rope.freqs": torch.ones(8)}
    loaded = from_meta(meta)
    assert set(loaded) == set(ours)
    Transformer(ARGS).load_state_dict(loaded, strict=True)


def _split_like_meta(sd, n, embedding_dim):
    """Meta's model-parallel layout: column-parallel rows, row-parallel columns, embedding by family."""
    shards = [{} for _ in range(n)]
    for key, value in sd.items():
        if key.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight")):
            parts = value.chunk(n, dim=0)
        elif key.endswith(("wo.weight", "w2.weight")):
            parts = value.chunk(n, dim=1)
        elif key == "tok_embeddings.weight":
            parts = value.chunk(n, dim=embedding_dim)
        else:
            parts = [value] * n
        for shard, part in zip(shards, parts):
            shard[key] = part.clone()
    for shard in shards:
        shard["rope.freqs"] = torch.ones(4)
    return shards


@pytest.mark.parametrize("family, embedding_dim", [("llama2", 1), ("llama3", 0)])
def test_from_meta_merges_model_parallel_shards(family, embedding_dim):
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128, family=family)
    ours = _state_dict(args)
    merged = from_meta(_split_like_meta(ours, 2, embedding_dim), args)
    assert set(merged) == set(ours)
    for key, value in ours.items():
        assert torch.equal(merged[key], value), key


def test_merging_meta_shards_needs_args():
    with pytest.raises(CheckpointError, match="needs the model args"):
        from_meta(_split_like_meta(_state_dict(), 2, 0))


def test_llama_3_1_and_3_2_configs_import_as_their_flavors():
    base = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
    args = args_from_hf_config(base)  # Llama 3.2 1B's config.json
    assert (args.family, args.flavor, args.tie_embeddings, args.rope_scaling_factor) == ("llama3", "1B", True, 32.0)
    llama31_8b = dict(base, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, tie_word_embeddings=False,
                      rope_scaling=dict(base["rope_scaling"], factor=8.0))
    assert args_from_hf_config(llama31_8b).flavor == "3.1-8B"
    assert args_from_hf_config(dict(llama31_8b, rope_scaling=None)).flavor == "8B"

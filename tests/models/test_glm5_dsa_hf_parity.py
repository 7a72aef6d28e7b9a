"""GLM-5 (the deepseek_v32 family's glm_moe_dsa variant) against transformers' GlmMoeDsaForCausalLM (fp32, CPU):
logits with the top-k selection active and layers that reuse the previous full layer's selection, 20 AdamW steps,
the Hugging Face directory both ways (shared layers hold no indexer), the indexer's KL losses against the hand
computation, and the config.json forms of the layer pattern."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from dsa_reference import hand_indexer_loss, randomise_dsa
from hf_reference import (
    adamw_steps,
    hf_model,
    import_hf_model,
    logits,
    memorisable_batches,
    random_tokens,
    round_trip_hf_dir,
    use_reference_kernels,
)

from titan_npu.errors import CheckpointError
from titan_npu.models.deepseek_v32.args import DSAArgs
from titan_npu.models.registry import get_spec

transformers = pytest.importorskip("transformers")

TOL = 1e-5
STEP_RTOL = 1e-4
KL_RTOL = 1e-5
SEQ = 32

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)

# Layer 0 dense, 1-3 MoE (one group, as GLM-5); layers 1 and 3 reuse layers 0 and 2's selection; top-6 of 32.
ARGS = DSAArgs(dim=64, n_layers=4, n_heads=4, vocab_size=160, ffn_dim=96, norm_eps=1e-5, rope_theta=10000.0,
               max_seq_len=128, family="deepseek_v32", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1,
               n_groups=1, topk_groups=1, route_scale=2.5, first_k_dense=1, index_n_heads=4, index_head_dim=16,
               index_topk=6, indexer_types=["full", "shared", "full", "shared"], variant="glm_moe_dsa")


def _pair(seed: int, args: DSAArgs = ARGS, hf_topk: int | None = None):
    hf = hf_model("deepseek_v32", args if hf_topk is None else dataclasses.replace(args, index_topk=hf_topk))
    randomise_dsa(hf, seed)
    return hf, import_hf_model("deepseek_v32", hf, args)


def test_logits_with_shared_selections_are_transformers_and_the_rope_layout_matters():
    hf, ours = _pair(0)
    assert [layer.self_attn.indexer is None for layer in hf.model.layers] == [False, True, False, True]
    tokens = random_tokens(ARGS.vocab_size, SEQ, 1)
    assert (logits(ours.eval(), tokens) - logits(hf, tokens)).abs().max().item() < TOL
    # DeepSeek-V3.2's half-split indexer RoPE on the same weights (every layer with its indexer) selects other keys.
    full = dataclasses.replace(ARGS, indexer_types=None)
    hf_full, ours_full = _pair(0, full)
    half = import_hf_model("deepseek_v32", hf_full, dataclasses.replace(full, variant="deepseek_v32")).eval()
    assert (logits(ours_full.eval(), tokens) - logits(hf_full, tokens)).abs().max().item() < TOL
    assert (logits(half, tokens) - logits(hf_full, tokens)).abs().max().item() > 1000 * TOL


def _ce(model, tokens, labels):
    out = model(tokens)
    out = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


def test_twenty_adamw_steps_with_frozen_indexers_track_a_transformers_training_loop():
    args = dataclasses.replace(ARGS, indexer_loss_weight=0.0)
    hf, ours = _pair(7, args)
    hf.train(), ours.train()
    batches = memorisable_batches(args.vocab_size, SEQ, 20, batch=2)
    ours_losses = adamw_steps(ours, batches, _ce)
    hf_losses = adamw_steps(hf, batches, _ce)
    assert ours_losses[-1] < ours_losses[0] - 1.0
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


def test_a_glm_moe_dsa_directory_reads_and_exports_back_with_its_layer_pattern(tmp_path):
    hf = hf_model("deepseek_v32", ARGS)
    randomise_dsa(hf, 9)
    weights, ours, back = round_trip_hf_dir(hf, "deepseek_v32", tmp_path)
    assert weights.args == ARGS
    exported = get_spec("deepseek_v32").hf.to_hf(ours.state_dict(), ARGS)
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in exported
    assert not any(k.startswith("model.layers.1.self_attn.indexer") for k in exported)
    assert back.config.indexer_types == ARGS.indexer_types and back.config.model_type == "glm_moe_dsa"
    tokens = random_tokens(ARGS.vocab_size, SEQ, 10)
    assert (logits(ours.eval(), tokens) - logits(hf, tokens)).abs().max().item() < TOL
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_the_indexer_loss_equals_the_hand_computation_with_shared_layers(stage):
    dense = stage == "dense_warmup"
    args = dataclasses.replace(ARGS, dsa_stage=stage)
    hf, ours = _pair(3, args, hf_topk=SEQ if dense else None)
    tokens = random_tokens(args.vocab_size, SEQ, 4)
    ours.train()
    with torch.no_grad():
        ours(tokens)
    hand = hand_indexer_loss(hf, tokens, None if dense else args.index_topk, interleaved=True)
    assert hand.item() > 0.01
    assert abs(ours.indexer_loss().item() - hand.item()) <= KL_RTOL * hand.item()


@pytest.mark.parametrize("fields", [
    {"index_topk_freq": 2, "index_skip_topk_offset": 2},
    {"index_topk_pattern": "FFSF"},
    {"indexer_types": ["full", "shared", "shared", "full"]},
])
def test_the_layer_pattern_reads_from_each_config_json_form_as_transformers_reads_it(fields):
    spec = get_spec("deepseek_v32")
    config = {**{k: v for k, v in spec.hf.config(ARGS).items() if k != "indexer_types"}, **fields}
    expected = transformers.GlmMoeDsaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    assert spec.hf.args_from_config(config).indexer_types == expected.indexer_types


def test_a_checkpoint_whose_indexers_disagree_with_the_layer_pattern_is_refused():
    hf = hf_model("deepseek_v32", dataclasses.replace(ARGS, indexer_types=None))  # every layer has an indexer
    with pytest.raises(CheckpointError, match="holds an indexer in layer 1 .* reuse layer 0's selection"):
        get_spec("deepseek_v32").hf.from_hf(hf.state_dict(), ARGS)
    state = {k: v for k, v in hf.state_dict().items() if "layers.2.self_attn.indexer" not in k
             and "layers.1.self_attn.indexer" not in k and "layers.3.self_attn.indexer" not in k}
    with pytest.raises(CheckpointError, match="lacks the lightning indexer's weights of layer 2"):
        get_spec("deepseek_v32").hf.from_hf(state, ARGS)
    with pytest.raises(CheckpointError, match="indexer_rope_interleave=false"):
        get_spec("deepseek_v32").hf.args_from_config({**get_spec("deepseek_v32").hf.config(ARGS),
                                                     "indexer_rope_interleave": False})

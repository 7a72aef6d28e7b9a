"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention; the deepseek_v32 family's two variants) against transformers'
DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM (fp32, CPU): logits with the indexer's top-k selection active (and
GLM-5's layers that reuse the last full layer's selection), 20 AdamW steps, the Hugging Face directory both ways,
and the indexer's KL losses of both training stages against a hand computation from the DeepSeek-V3.2 report's
definitions."""

from __future__ import annotations

import dataclasses
import json

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

TOL = 1e-5  # max abs logit difference, fp32
STEP_RTOL = 1e-4  # each training step's loss, relative
KL_RTOL = 1e-5  # the indexer loss against the hand computation, relative
SEQ = 32

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)

# Layer 0 dense, layers 1-2 MoE in 4 groups; an indexer of 4 heads of 16 keeping 6 of up to 32 keys per query.
ARGS = DSAArgs(dim=64, n_layers=3, n_heads=4, vocab_size=160, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
               max_seq_len=128, family="deepseek_v32", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1,
               n_groups=4, topk_groups=2, route_scale=2.5, first_k_dense=1, index_n_heads=4, index_head_dim=16,
               index_topk=6)
# GLM-5's layout: 4 layers, the MoE in one group, the indexer's RoPE on interleaved pairs, layers 1 and 3 reusing
# layers 0 and 2's selection.
GLM5 = dataclasses.replace(ARGS, n_layers=4, norm_eps=1e-5, n_groups=1, topk_groups=1, variant="glm_moe_dsa",
                           indexer_types=["full", "shared", "full", "shared"])
SHAPES = {"v3.2": ARGS, "glm5-shared": GLM5}


def _pair(seed: int, args: DSAArgs = ARGS, hf_topk: int | None = None):
    """transformers' model (index_topk hf_topk, default the args') with weights from `seed`, and ours holding them."""
    hf_args = args if hf_topk is None else dataclasses.replace(args, index_topk=hf_topk)
    hf = hf_model("deepseek_v32", hf_args)
    randomise_dsa(hf, seed)
    return hf, import_hf_model("deepseek_v32", hf, args)


def _ce(model, tokens, labels):
    out = model(tokens)
    out = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_with_the_sparse_selection_active_are_transformers(shape):
    args = SHAPES[shape]
    hf, ours = _pair(0, args)
    assert [layer.self_attn.indexer is None for layer in hf.model.layers] == [
        not args.has_indexer(i) for i in range(args.n_layers)]
    tokens = random_tokens(args.vocab_size, SEQ, 1)
    assert (logits(ours.eval(), tokens) - logits(hf, tokens)).abs().max().item() < TOL
    # The selection matters: the same weights with every key kept give other logits.
    dense = import_hf_model("deepseek_v32", hf, dataclasses.replace(args, index_topk=SEQ)).eval()
    assert (logits(dense, tokens) - logits(hf, tokens)).abs().max().item() > 1000 * TOL


def test_glm5s_indexer_rotates_interleaved_pairs():
    # DeepSeek-V3.2's half-split indexer RoPE on GLM-5's weights (every layer with its indexer) selects other keys.
    full = dataclasses.replace(GLM5, indexer_types=None)
    hf, ours = _pair(0, full)
    half = import_hf_model("deepseek_v32", hf, dataclasses.replace(full, variant="deepseek_v32")).eval()
    tokens = random_tokens(full.vocab_size, SEQ, 1)
    assert (logits(ours.eval(), tokens) - logits(hf, tokens)).abs().max().item() < TOL
    assert (logits(half, tokens) - logits(hf, tokens)).abs().max().item() > 1000 * TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_twenty_adamw_steps_with_frozen_indexers_track_a_transformers_training_loop(shape):
    # transformers' indexer runs without gradient: indexer_loss_weight = 0 is that training.
    args = dataclasses.replace(SHAPES[shape], indexer_loss_weight=0.0)
    hf, ours = _pair(7, args)
    hf.train(), ours.train()
    batches = memorisable_batches(args.vocab_size, SEQ, 20, batch=2)
    ours_losses = adamw_steps(ours, batches, _ce)
    hf_losses = adamw_steps(hf, batches, _ce)
    assert ours_losses[-1] < ours_losses[0] - 1.0
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_hf_directory_reads_by_its_model_type_and_exports_back_with_the_indexers(shape, tmp_path):
    args = SHAPES[shape]
    hf = hf_model("deepseek_v32", args)
    randomise_dsa(hf, 9)
    weights, ours, back = round_trip_hf_dir(hf, "deepseek_v32", tmp_path)
    assert weights.args == args
    exported = get_spec("deepseek_v32").hf.to_hf(ours.state_dict(), args)
    for layer in range(args.n_layers):  # GLM-5's shared layers hold no indexer
        assert (f"model.layers.{layer}.self_attn.indexer.weights_proj.weight" in exported) == args.has_indexer(layer)
    assert (back.config.model_type, back.config.index_topk, back.config.index_n_heads) == (args.variant, 6, 4)
    assert getattr(back.config, "indexer_types", None) == (args.indexer_types if args.indexer_types else
                                                          getattr(hf.config, "indexer_types", None))
    tokens = random_tokens(args.vocab_size, SEQ, 10)
    assert (logits(ours.eval(), tokens) - logits(hf, tokens)).abs().max().item() < TOL
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_the_indexer_loss_equals_the_hand_computation_from_the_reports_definitions(shape, stage):
    dense = stage == "dense_warmup"
    args = dataclasses.replace(SHAPES[shape], dsa_stage=stage)
    # The dense warm-up attends to every key: transformers' model keeps them all (index_topk = the sequence).
    hf, ours = _pair(3, args, hf_topk=SEQ if dense else None)
    tokens = random_tokens(args.vocab_size, SEQ, 4)
    ours.train()
    with torch.no_grad():
        ours(tokens)
    hand = hand_indexer_loss(hf, tokens, None if dense else args.index_topk, interleaved=args.indexer_rope_interleave)
    assert hand.item() > 0.01
    assert abs(ours.indexer_loss().item() - hand.item()) <= KL_RTOL * hand.item()
    assert abs(ours.auxiliary_loss().item() - hand.item()) <= KL_RTOL * hand.item()  # weight 1, no balance loss


def test_a_checkpoint_without_a_layers_indexer_is_refused_naming_it():
    hf = hf_model("deepseek_v32", ARGS)
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.self_attn.indexer.wk" not in k}
    with pytest.raises(CheckpointError, match=r"lacks the lightning indexer's weights of layer 1 \(model\.layers\.1\."
                                              r"self_attn\.indexer\.wk\.weight\)"):
        get_spec("deepseek_v32").hf.from_hf(state, ARGS)


def test_the_dense_warmup_trains_the_indexers_alone_and_the_sparse_stage_detaches_them():
    tokens = random_tokens(ARGS.vocab_size, SEQ, 5)
    labels = random_tokens(ARGS.vocab_size, SEQ, 6)
    grads = {}
    for stage, weight in (("dense_warmup", 1.0), ("sparse", 1.0), ("sparse", 0.0)):
        _, ours = _pair(11, dataclasses.replace(ARGS, dsa_stage=stage, indexer_loss_weight=weight))
        ours.train()
        (_ce(ours, tokens, labels) + (ours.auxiliary_loss() if weight else 0)).backward()
        grads[stage, weight] = {n: p.grad for n, p in ours.named_parameters()}
        trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
        indexers = {n for n, _ in ours.named_parameters() if ".indexer." in n}
        assert trainable == (indexers if stage == "dense_warmup" else
                             set(grads[stage, weight]) - (set() if weight else indexers))
    warmup, sparse, frozen = grads["dense_warmup", 1.0], grads["sparse", 1.0], grads["sparse", 0.0]
    assert all((g is not None) == (".indexer." in n) for n, g in warmup.items())
    assert all(g.abs().sum() > 0 for n, g in warmup.items() if ".indexer." in n)
    # Sparse stage: the language-model loss reaches the model exactly as with frozen indexers (the indexer's input is
    # detached and its loss touches nothing else), and the indexers learn from their loss.
    for name, grad in sparse.items():
        if ".indexer." in name:
            assert frozen[name] is None and grad.abs().sum() > 0
        else:
            assert torch.equal(grad, frozen[name]), name


def test_document_masking_keeps_each_documents_keys_and_selection_its_own():
    from titan_npu.ops.documents import Documents

    # 16 indexer heads: a key scores exactly 0 only when all 16 ReLUs are 0, so no tie at the k-th score makes the
    # top-k of a 32-key row and of a 20-key row differ (with 4 heads such ties occur, and torch.topk breaks them by
    # the row's layout).
    _, ours = _pair(13, dataclasses.replace(ARGS, index_n_heads=16))
    ours.eval()
    tokens = random_tokens(ARGS.vocab_size, SEQ, 14, batch=1)
    cut = 20
    ids = torch.tensor([[0] * cut + [1] * (SEQ - cut)])
    positions = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]).unsqueeze(0)
    with torch.no_grad():
        packed = ours(tokens, documents=Documents(ids, [cut, SEQ], positions))
        first, second = ours(tokens[:, :cut]), ours(tokens[:, cut:])
    assert (packed - torch.cat([first, second], dim=1)).abs().max().item() < TOL


def test_the_published_flavors_read_back_from_their_config():
    from titan_npu.config.schema import ModelConfig
    from titan_npu.models.registry import build_model_args

    spec = get_spec("deepseek_v32")
    for flavor in ("V3.2-Exp", "V3.2"):
        args = build_model_args(ModelConfig(name="deepseek_v32", flavor=flavor))
        assert (args.index_n_heads, args.index_head_dim, args.index_topk, args.n_layers) == (64, 128, 2048, 61)
        config = spec.hf.config(args)
        assert json.loads(json.dumps(config))["model_type"] == "deepseek_v32"
        assert spec.hf.args_from_config({**config, "num_nextn_predict_layers": 1}).flavor == "V3.2-Exp"


def test_the_glm5_flavor_is_transformers_glm_moe_dsa_config_and_reads_back_by_name():
    from titan_npu.config.schema import ModelConfig
    from titan_npu.models.registry import build_model_args, parse_model_name

    args = build_model_args(ModelConfig(name="deepseek_v32", flavor="GLM-5"))
    config = get_spec("deepseek_v32").hf.config(args)
    published = transformers.GlmMoeDsaConfig().to_dict()  # the class of zai-org/GLM-5, its defaults
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
              "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
              "routed_scaling_factor", "first_k_dense_replace", "index_topk", "index_head_dim", "index_n_heads",
              "max_position_embeddings", "rms_norm_eps", "indexer_types")
    assert {k: config[k] for k in fields} == {k: published[k] for k in fields}
    assert config["rope_parameters"]["rope_theta"] == published["rope_parameters"]["rope_theta"]
    assert get_spec("deepseek_v32").hf.args_from_config(config).flavor == "GLM-5"
    assert parse_model_name("glm_moe_dsa") == parse_model_name("GLM-5") == ("deepseek_v32", None)
    assert parse_model_name("DeepSeek-V3.2-Exp") == ("deepseek_v32", "V3.2-Exp")


@pytest.mark.parametrize("fields", [
    {"index_topk_freq": 2, "index_skip_topk_offset": 2},
    {"index_topk_pattern": "FFSF"},
    {"indexer_types": ["full", "shared", "shared", "full"]},
])
def test_the_layer_pattern_reads_from_each_config_json_form_as_transformers_reads_it(fields):
    spec = get_spec("deepseek_v32")
    config = {**{k: v for k, v in spec.hf.config(GLM5).items() if k != "indexer_types"}, **fields}
    expected = transformers.GlmMoeDsaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    assert spec.hf.args_from_config(config).indexer_types == expected.indexer_types


def test_a_checkpoint_whose_indexers_disagree_with_the_layer_pattern_is_refused():
    hf = hf_model("deepseek_v32", dataclasses.replace(GLM5, indexer_types=None))  # every layer has an indexer
    with pytest.raises(CheckpointError, match="holds an indexer in layer 1 .* reuse layer 0's selection"):
        get_spec("deepseek_v32").hf.from_hf(hf.state_dict(), GLM5)
    state = {k: v for k, v in hf.state_dict().items() if "layers.2.self_attn.indexer" not in k
             and "layers.1.self_attn.indexer" not in k and "layers.3.self_attn.indexer" not in k}
    with pytest.raises(CheckpointError, match="lacks the lightning indexer's weights of layer 2"):
        get_spec("deepseek_v32").hf.from_hf(state, GLM5)
    with pytest.raises(CheckpointError, match="indexer_rope_interleave=false"):
        get_spec("deepseek_v32").hf.args_from_config({**get_spec("deepseek_v32").hf.config(GLM5),
                                                     "indexer_rope_interleave": False})

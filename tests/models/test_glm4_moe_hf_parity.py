"""GLM-4.5 against Hugging Face transformers (Glm4MoeForCausalLM; fp32, CPU): the same logits after import (q/k norms
on and off, q/k/v biases on and off, partial RoPE, dense first layers, shared experts, group-limited routing with a
non-zero score-correction bias), losses that track a plain transformers training loop for 20 steps, a directory that
reads by its model_type and exports back loadable by the Auto classes, the multi-token-prediction layer of a published
checkpoint set aside on import, and a config.json this family cannot run refused in one line by `titan-npu import`."""

import json

import pytest
import torch
from hf_reference import (
    adamw_steps,
    hf_model,
    import_hf_model,
    logits,
    memorisable_batches,
    random_tokens,
    randomise,
    round_trip_hf_dir,
    save_hf_dir,
    use_reference_kernels,
)
from tiny_run import snapshot

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.glm4_moe.args import Glm4MoeArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of order 1)
STEP_RTOL = 1e-4  # each of 20 training steps' loss, relative

_BASE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=160, ffn_dim=96, norm_eps=1e-5,
             rope_theta=10000.0, max_seq_len=128, family="glm4_moe", n_experts=8, top_k=2, moe_ffn_dim=24)
SHAPES = {
    # GLM-4.5's options: q/k norms, q/k/v biases, half of each head rotated, the first layer dense, 4 groups of 2
    # experts (top-2 from the best 2 groups), weights renormalised and scaled by 2.5, one shared expert.
    "qk-norm-groups": Glm4MoeArgs(**_BASE, qk_norm=True, qkv_bias=True, partial_rotary_factor=0.5, n_groups=4,
                                  topk_groups=2, route_scale=2.5, first_k_dense=1, n_shared_experts=1),
    # GLM-4.5-Air's (no q/k norms) with the rest moved: no biases, a quarter rotated, two dense layers, one group,
    # weights not renormalised, two shared experts.
    "plain-one-group": Glm4MoeArgs(**_BASE, qk_norm=False, qkv_bias=False, partial_rotary_factor=0.25, n_groups=1,
                                   topk_groups=1, route_scale=1.0, first_k_dense=2, n_shared_experts=2,
                                   norm_topk_prob=False),
}

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


def _pair(shape: str, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' model with random weights and score-correction biases, and ours holding them."""
    args = SHAPES[shape]
    hf = hf_model("glm4_moe", args)
    randomise(hf, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return hf, import_hf_model("glm4_moe", hf, args)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_imported_give_hf_logits(shape):
    args = SHAPES[shape]
    hf, ours = _pair(shape, seed=0)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert [type(layer.mlp).__name__ for layer in hf.model.layers][:args.first_k_dense + 1] == \
        ["Glm4MoeMLP"] * args.first_k_dense + ["Glm4MoeMoE"]
    assert hf.model.rotary_emb.inv_freq.numel() == args.rotary_dim // 2 < args.head_dim // 2
    tokens = random_tokens(args.vocab_size, 48, 1)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_the_score_correction_bias_changes_the_choice_and_is_imported():
    hf, ours = _pair("qk-norm-groups", seed=4)
    tokens = random_tokens(SHAPES["qk-norm-groups"].vocab_size, 48, 5)
    with torch.no_grad():
        for layer in ours.layers.values():
            if hasattr(layer.feed_forward, "router"):
                layer.feed_forward.router.score_bias.zero_()
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() > 100 * TOL


def _loss(model, tokens, labels):
    out = model(tokens)
    return torch.nn.functional.cross_entropy((out.logits if hasattr(out, "logits") else out).flatten(0, 1),
                                             labels.flatten())


def test_twenty_steps_from_imported_weights_track_a_transformers_training_loop():
    hf, ours = _pair("qk-norm-groups", seed=3)
    hf.train()
    ours.train()
    batches = memorisable_batches(SHAPES["qk-norm-groups"].vocab_size, 24, 20, batch=2)
    ours_losses = adamw_steps(ours, batches, _loss, lr=1e-3)
    hf_losses = adamw_steps(hf, batches, _loss, lr=1e-3)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(tmp_path):
    args = SHAPES["qk-norm-groups"]
    hf, _ = _pair("qk-norm-groups", seed=9)
    weights, ours, back = round_trip_hf_dir(hf, "glm4_moe", tmp_path)
    assert weights.format == "hf" and weights.args == args
    tokens = random_tokens(args.vocab_size, 48, 10)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    assert back.config.model_type == "glm4_moe"
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_a_published_checkpoints_multi_token_prediction_layer_is_set_aside_on_import(tmp_path, caplog):
    args = SHAPES["plain-one-group"]
    hf, _ = _pair("plain-one-group", seed=6)
    state = {k: v for k, v in get_spec("glm4_moe").hf.to_hf(import_hf_model("glm4_moe", hf, args).state_dict(),
                                                              args).items()}
    # The published layout: the layer after the last one holds eh_proj, enorm, hnorm, shared_head and a MoE block.
    mtp = f"model.layers.{args.n_layers}"
    state.update({f"{mtp}.eh_proj.weight": torch.zeros(args.dim, 2 * args.dim), f"{mtp}.enorm.weight":
                  torch.ones(args.dim), f"{mtp}.mlp.gate.weight": torch.zeros(args.n_experts, args.dim)})
    config = {**get_spec("glm4_moe").hf.config(args), "num_nextn_predict_layers": 1}
    save_hf_dir(state, config, tmp_path / "hf")
    with caplog.at_level("INFO"):
        weights = read_weights(tmp_path / "hf")
    assert weights.args == args and f"layers [{args.n_layers}] of the checkpoint (multi-token prediction) set aside" \
        in caplog.text
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    tokens = random_tokens(args.vocab_size, 32, 7)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize(("field", "value", "named"), [
    ("scoring_func", "softmax", "scoring_func='softmax'"), ("topk_method", "greedy", "topk_method='greedy'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"), ("n_group", 3, "model.n_groups=3 must divide"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn' is not supported")])
def test_a_glm_config_this_family_cannot_run_is_refused_by_import_in_one_line(tmp_path, capsys, field, value, named):
    args = SHAPES["qk-norm-groups"]
    spec = get_spec("glm4_moe")
    save_hf_dir(spec.hf.to_hf(build_model(args).state_dict(), args), {**spec.hf.config(args), field: value},
                tmp_path / "hf")
    before = snapshot(tmp_path)
    rc = main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("CheckpointError: config.json ") and named in err, err
    assert snapshot(tmp_path) == before


def test_exported_config_declares_no_multi_token_prediction_layer():
    config = get_spec("glm4_moe").hf.config(SHAPES["qk-norm-groups"])
    assert config["num_nextn_predict_layers"] == 0 and json.dumps(config)
    assert transformers.AutoConfig.for_model(**config).num_nextn_predict_layers == 0


def test_cached_decoding_of_the_partly_rotated_model_equals_its_full_forward():
    from titan_npu.tools.generate import CachedLlama

    _, ours = _pair("qk-norm-groups", seed=12)
    tokens = random_tokens(SHAPES["qk-norm-groups"].vocab_size, 20, 13)
    full = logits(ours, tokens)
    dec = CachedLlama(ours, max_len=20, batch_size=2)
    cached = torch.cat([dec.forward(tokens[:, :12], 0), *[dec.forward(tokens[:, i:i + 1], i) for i in range(12, 20)]],
                       dim=1)
    assert (cached - full).abs().max().item() < TOL

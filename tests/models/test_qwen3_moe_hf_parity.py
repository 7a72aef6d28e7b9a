"""Qwen3-MoE against Hugging Face transformers' Qwen3MoeForCausalLM (fp32, CPU): the same logits after import and
export, the same first-step loss (cross entropy + router_aux_loss_coef x aux loss), and losses that track a plain
transformers training loop for 20 steps from the imported weights."""

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
    use_reference_kernels,
)

from titan_npu.checkpoint.formats import read_weights
from titan_npu.models.qwen3_moe.args import MoEDecoderArgs
from titan_npu.models.registry import build_model, get_spec, spec_for_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of unit scale)
LOSS_RTOL = 1e-5  # the first step's loss, relative
STEP_RTOL = 1e-4  # each of 20 training steps' loss, relative (measured: at most 7e-6)
SEQ_LEN = 32

_BASE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=160, ffn_dim=96, norm_eps=1e-6,
             rope_theta=1000000.0, max_seq_len=128, qk_norm=True, family="qwen3_moe", n_experts=8, top_k=2,
             moe_ffn_dim=32, router_aux_loss_coef=0.02)
SHAPES = {
    "all-moe-normalised": MoEDecoderArgs(**_BASE),
    # Layer 1 dense by mlp_only_layers, layer 0 by the sparse step (only odd ids are MoE), top-k not renormalised.
    "mixed-unnormalised": MoEDecoderArgs(**{**_BASE, "norm_topk_prob": False, "decoder_sparse_step": 2,
                                            "n_layers": 4, "mlp_only_layers": [3]}),
}


_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init (norms near 1, router logits of order 1), so a wrong mapping shows."""
    randomise(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate." in name:
                p.mul_(0.3 / 0.08)


def test_the_model_counts_its_parameters_and_builds_the_layers_transformers_does():
    args = SHAPES["mixed-unnormalised"]
    ours = build_model(args)
    assert sum(p.numel() for p in ours.parameters()) == args.num_params()
    hf = hf_model("qwen3_moe", args)
    assert sum(p.numel() for p in hf.parameters()) == args.num_params()
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe == [i for i in range(args.n_layers) if args.is_moe_layer(i)] == [1]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_imported_give_hf_logits(shape):
    args = SHAPES[shape]
    hf = hf_model("qwen3_moe", args)
    _randomise(hf, seed=0)
    ours = import_hf_model("qwen3_moe", hf, args)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 1)
    with torch.no_grad():
        assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_first_step_loss_with_the_aux_term_equals_transformers(shape):
    args = SHAPES[shape]
    hf = hf_model("qwen3_moe", args)
    _randomise(hf, seed=11)
    ours = import_hf_model("qwen3_moe", hf, args)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 12)
    with torch.no_grad():
        out = hf(tokens, labels=tokens, output_router_logits=True)  # shifts the labels itself
        logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(ours.load_balancing_loss().item() - out.aux_loss.item()) <= LOSS_RTOL * out.aux_loss.item()
    total = (ce + ours.auxiliary_loss()).item()
    assert abs(total - out.loss.item()) <= LOSS_RTOL * out.loss.item()
    assert args.router_aux_loss_coef * out.aux_loss.item() > 100 * LOSS_RTOL * out.loss.item()  # the aux term counts


def _ours_loss(model, tokens, labels):
    """Cross entropy + the aux term, as our trainer optimises it."""
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()) + model.auxiliary_loss()


def _hf_loss(model, tokens, labels):
    """transformers' cross entropy + coef x its aux loss."""
    out = model(tokens, output_router_logits=True)
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) \
        + model.router_aux_loss_coef * out.aux_loss


# The mixed shape's logits and first-step loss are checked by default above; its 20-step loop runs with -m slow.
@pytest.mark.parametrize("shape", ["all-moe-normalised",
                                   pytest.param("mixed-unnormalised", marks=pytest.mark.slow)])
def test_twenty_steps_from_imported_weights_track_a_transformers_training_loop(shape):
    args = SHAPES[shape]
    hf = hf_model("qwen3_moe", args).train()
    _randomise(hf, seed=7)
    ours = import_hf_model("qwen3_moe", hf, args).train()
    batches = memorisable_batches(args.vocab_size, SEQ_LEN, 20)
    ours_losses = adamw_steps(ours, batches, _ours_loss)
    hf_losses = adamw_steps(hf, batches, _hf_loss)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(tmp_path):
    args = SHAPES["mixed-unnormalised"]
    hf = hf_model("qwen3_moe", args)
    _randomise(hf, seed=9)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert spec_for_hf_config(config).name == "qwen3_moe"
    weights = read_weights(tmp_path / "hf")  # per-expert tensors on disk
    assert weights.format == "hf" and weights.args == args
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 10)
    with torch.no_grad():
        assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    spec = get_spec("qwen3_moe")
    exported = spec.hf.to_hf(ours.state_dict(), weights.args)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported and "model.layers.1.mlp.gate.weight" in exported
    out = tmp_path / "back"
    out.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in exported.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(spec.hf.config(weights.args)))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "head_dim"):
        assert getattr(back.config, field) == getattr(hf.config, field), field
    with torch.no_grad():
        assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL

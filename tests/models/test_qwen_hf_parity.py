"""Qwen3 and Qwen2.5 against Hugging Face transformers (fp32, CPU): the same logits after import and export, and the
same losses over 30 optimizer steps from the imported weights, through the registry's adapters."""

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
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.registry import build_model, get_spec, spec_for_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of unit scale)
STEP_RTOL = 1e-4  # per-step loss, relative

_QWEN3 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=160, ffn_dim=96, norm_eps=1e-6,
              rope_theta=1000000.0, max_seq_len=128, qk_norm=True, family="qwen3")
_QWEN2 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_dim=96, norm_eps=1e-6,
              rope_theta=1000000.0, max_seq_len=128, qkv_bias=True, family="qwen2")
# Non-default head_dim (32 with dim 64 / 4 heads = 16), GQA, tied and untied.
SHAPES = {
    "qwen3-tied": DecoderArgs(**_QWEN3, tie_embeddings=True),
    "qwen3-untied": DecoderArgs(**_QWEN3),
    "qwen3-mha-head16": DecoderArgs(**{**_QWEN3, "n_kv_heads": 4, "head_dim": None}),
    "qwen2-tied": DecoderArgs(**_QWEN2, tie_embeddings=True),
    "qwen2-untied": DecoderArgs(**_QWEN2),
}
SEQ_LEN = 48


_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_imported_give_hf_logits(shape):
    args = SHAPES[shape]
    hf = hf_model(args.family, args)
    randomise(hf, seed=0)
    ours = import_hf_model(args.family, hf, args, tie_word_embeddings=args.tie_embeddings)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 1)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_our_weights_exported_give_our_logits_in_hf(shape):
    args = SHAPES[shape]
    torch.manual_seed(2)
    ours = build_model(args)
    ours.init_weights(seed=2)
    randomise(ours, seed=3)
    hf = hf_model(args.family, args)
    missing, unexpected = hf.load_state_dict(get_spec(args.family).hf.to_hf(ours.state_dict(), args), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if args.tie_embeddings else [])
    hf.tie_weights()
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 4)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_a_tied_model_holds_one_matrix_for_embedding_and_output():
    ours = build_model(SHAPES["qwen3-tied"])
    assert ours.output.weight is ours.tok_embeddings.weight
    names = [n for n, _ in ours.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert sum(p.numel() for p in ours.parameters()) == SHAPES["qwen3-tied"].num_params()
    assert sum(p.numel() for p in build_model(SHAPES["qwen3-untied"]).parameters()) == \
        SHAPES["qwen3-untied"].num_params()


def test_the_parity_check_would_catch_unpermuted_q_k_norms():
    args = SHAPES["qwen3-untied"]
    hf = hf_model(args.family, args)
    randomise(hf, seed=5)
    ours = import_hf_model(args.family, hf, args, tie_word_embeddings=args.tie_embeddings)
    with torch.no_grad():
        for layer in ours.layers.values():  # the HF channel order, as a mapping without the permutation would give
            i = int(layer.layer_id)
            layer.attention.q_norm.weight.copy_(hf.model.layers[i].self_attn.q_norm.weight)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 6)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() > 100 * TOL


def _cross_entropy(model, tokens, labels):
    out = model(tokens)
    out = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("shape", ["qwen3-tied", "qwen2-untied"])
def test_thirty_steps_from_imported_weights_match_a_transformers_training_loop(shape):
    args = SHAPES[shape]
    hf = hf_model(args.family, args).train()
    randomise(hf, seed=7)
    ours = import_hf_model(args.family, hf, args, tie_word_embeddings=args.tie_embeddings).train()
    batches = memorisable_batches(args.vocab_size, SEQ_LEN, 30)
    ours_losses = adamw_steps(ours, batches, _cross_entropy)
    hf_losses = adamw_steps(hf, batches, _cross_entropy)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


@pytest.mark.parametrize("shape", ["qwen3-tied", "qwen2-untied"])
def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(shape, tmp_path):
    args = SHAPES[shape]
    hf = hf_model(args.family, args)
    randomise(hf, seed=9)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert spec_for_hf_config(config).name == args.family
    weights = read_weights(tmp_path / "hf")
    assert weights.format == "hf" and weights.args.family == args.family
    assert (weights.args.head_dim, weights.args.tie_embeddings) == (args.head_dim, args.tie_embeddings)
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    ours.tie_weights()
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 10)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    # Back to a Hugging Face directory, loaded by the Auto class with the original model_type and fields.
    spec = get_spec(args.family)
    out = tmp_path / "back"
    out.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in spec.hf.to_hf(ours.state_dict(), weights.args).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(spec.hf.config(weights.args)))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert back.config.model_type == config["model_type"]
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "tie_word_embeddings", "rope_theta", "rms_norm_eps"):
        assert getattr(back.config, field, None) == getattr(hf.config, field, None), field
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL

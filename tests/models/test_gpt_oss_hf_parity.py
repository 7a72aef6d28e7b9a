"""gpt-oss against Hugging Face transformers' GptOssForCausalLM (fp32, CPU): the same logits after import and export
(sinks, sliding windows, YaRN, biased router and experts, clamped SwiGLU), the same first-step loss, losses that track
a plain transformers training loop for 20 steps, and MXFP4 expert weights dequantised as transformers does."""


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
    use_reference_kernels,
)

from titan_npu.models.gpt_oss.args import FULL, SLIDING, GptOssArgs
from titan_npu.models.gpt_oss.mxfp4 import dequantize_mxfp4
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of unit scale)
LOSS_RTOL = 1e-5  # the first step's loss, relative
STEP_RTOL = 1e-4  # each of 20 training steps' loss, relative
SEQ_LEN = 32

# A window of 8 of the 32 positions, YaRN stretching a 16-token context (its ramp inside the head dims).
_BASE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=160, ffn_dim=32, moe_ffn_dim=32,
             norm_eps=1e-5, rope_theta=150000.0, max_seq_len=128, family="gpt_oss", n_experts=8, top_k=4,
             sliding_window=8, router_aux_loss_coef=0.02, yarn_factor=4.0, yarn_original_seq_len=16)
SHAPES = {
    "alternating-yarn": GptOssArgs(**_BASE),
    # Two sliding layers in a row, plain RoPE, a tighter clamp (so the clamp bites), top-2.
    "custom-layers-plain-rope": GptOssArgs(**{**_BASE, "layer_types": [SLIDING, SLIDING, FULL], "yarn_factor": None,
                                              "yarn_original_seq_len": 4096, "swiglu_limit": 0.5, "top_k": 2}),
}

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init (norms near 1, router logits and sinks of order 1), so a wrong mapping shows."""
    randomise(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router." in name or "sinks" in name:
                p.mul_(0.5 / 0.08)


def test_the_model_counts_its_parameters_as_transformers_builds_them():
    args = SHAPES["alternating-yarn"]
    assert sum(p.numel() for p in build_model(args).parameters()) == args.num_params()
    hf = hf_model("gpt_oss", args)
    assert sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [8, None, 8]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_imported_give_hf_logits(shape):
    args = SHAPES[shape]
    hf = hf_model("gpt_oss", args)
    _randomise(hf, seed=0)
    ours = import_hf_model("gpt_oss", hf, args)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 1)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_the_sinks_and_the_window_change_the_logits():
    args = SHAPES["alternating-yarn"]
    hf = hf_model("gpt_oss", args)
    _randomise(hf, seed=3)
    ours = import_hf_model("gpt_oss", hf, args)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 4)
    before = logits(ours, tokens)
    with torch.no_grad():
        ours.layers["0"].attention.sinks.zero_()
    assert (logits(ours, tokens) - before).abs().max().item() > 100 * TOL
    ours.layers["0"].attention.window = None
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() > 100 * TOL


def test_the_first_step_loss_with_the_aux_term_equals_transformers():
    args = SHAPES["alternating-yarn"]
    hf = hf_model("gpt_oss", args)
    _randomise(hf, seed=11)
    ours = import_hf_model("gpt_oss", hf, args)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 12)
    with torch.no_grad():
        out = hf(tokens, labels=tokens, output_router_logits=True)
        ours_logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(ours_logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(ours.load_balancing_loss().item() - out.aux_loss.item()) <= LOSS_RTOL * out.aux_loss.item()
    assert abs((ce + ours.auxiliary_loss()).item() - out.loss.item()) <= LOSS_RTOL * out.loss.item()


def _ours_loss(model, tokens, labels):
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()) + model.auxiliary_loss()


def _hf_loss(model, tokens, labels):
    out = model(tokens, output_router_logits=True)
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) \
        + model.router_aux_loss_coef * out.aux_loss


def test_twenty_steps_from_imported_weights_track_a_transformers_training_loop():
    args = SHAPES["alternating-yarn"]
    hf = hf_model("gpt_oss", args).train()
    # Weights whose top-4 of 8 choices keep clear of ties for 20 steps (measured: 6e-6 at most): a token whose two
    # experts' logits differ by rounding flips between them and the runs part (seed 7: 3e-3 by step 20).
    _randomise(hf, seed=3)
    ours = import_hf_model("gpt_oss", hf, args).train()
    batches = memorisable_batches(args.vocab_size, SEQ_LEN, 20)
    ours_losses = adamw_steps(ours, batches, _ours_loss)
    hf_losses = adamw_steps(hf, batches, _hf_loss)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(tmp_path):
    args = SHAPES["custom-layers-plain-rope"]
    hf = hf_model("gpt_oss", args)
    _randomise(hf, seed=9)
    weights, ours, back = round_trip_hf_dir(hf, "gpt_oss", tmp_path)
    assert weights.format == "hf" and weights.args == args
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 10)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    for field in ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types", "swiglu_limit",
                  "router_aux_loss_coef", "head_dim", "rope_parameters"):
        assert getattr(back.config, field) == getattr(hf.config, field), field
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def _mxfp4(shape: tuple[int, ...], seed: int, exponents: tuple[int, int] = (120, 134)
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [*shape, 16] (every E2M1 code) and E8M0 scales [*shape] of exponents in [lo, hi)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(*exponents, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_experts_dequantise_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4((3, 10, 2), seed=0)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == (3, 64, 10) and torch.equal(ours, theirs)


def test_an_mxfp4_checkpoint_imports_its_experts_dequantised():
    args = SHAPES["alternating-yarn"]
    hf = hf_model("gpt_oss", args)
    _randomise(hf, seed=5)
    state = dict(hf.state_dict())
    e, d, f = args.n_experts, args.dim, args.moe_ffn_dim
    for layer in range(args.n_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for proj, rows, cols, seed in (("gate_up_proj", 2 * f, d, layer), ("down_proj", d, f, 10 + layer)):
            blocks, scales = _mxfp4((e, rows, cols // 32), seed, exponents=(118, 124))  # |w| <= 0.75
            with torch.no_grad():
                state.pop(f"{prefix}.{proj}").copy_(dequantize_mxfp4(blocks, scales))  # transformers' weights
            state[f"{prefix}.{proj}_blocks"], state[f"{prefix}.{proj}_scales"] = blocks, scales
    ours = build_model(args)
    ours.load_state_dict(get_spec("gpt_oss").hf.from_hf(state, args), strict=True)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 6)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_a_config_with_another_quantisation_is_refused_in_one_line():
    config = get_spec("gpt_oss").hf.config(SHAPES["alternating-yarn"])
    with pytest.raises(Exception, match="quant_method='fp8'.*only mxfp4"):
        get_spec("gpt_oss").hf.args_from_config({**config, "quantization_config": {"quant_method": "fp8"}})

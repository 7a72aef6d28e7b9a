"""Qwen3-Next / Qwen3.5 against Hugging Face transformers (Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM; fp32, CPU): the same logits after import (fused or separate linear-layer projections, zero-
centred norms, gated attention with partial RoPE, gated shared expert), packed documents equal to each document run
alone through transformers, the same first-step loss, losses that track a plain transformers training loop for 20
steps, and an export transformers loads as the same model."""


import numpy as np
import pytest
import torch
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

from titan_npu.models.qwen3_next.args import Qwen3NextArgs
from titan_npu.models.registry import build_model, get_spec
from titan_npu.ops.documents import Documents

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of order 1)
LOSS_RTOL = 1e-5  # the first step's loss, relative
STEP_RTOL = 1e-4  # each of 20 training steps' loss, relative
SEQ_LEN = 80  # two of the delta rule's 64-position chunks

# Linear, full, linear, full; two key heads serving four value heads; a quarter of each 32-dim head rotated.
_BASE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=160, ffn_dim=48, norm_eps=1e-6,
             rope_theta=10000.0, max_seq_len=256, family="qwen3_next", linear_n_k_heads=2, linear_n_v_heads=4,
             linear_k_head_dim=16, linear_v_head_dim=8, full_attention_interval=2)
_MOE = dict(n_experts=8, top_k=2, moe_ffn_dim=32, shared_ffn_dim=24, router_aux_loss_coef=0.02)
SHAPES = {
    "qwen3_next-moe": Qwen3NextArgs(**_BASE, **_MOE, variant="qwen3_next"),
    "qwen3_5-dense": Qwen3NextArgs(**_BASE, n_experts=0, variant="qwen3_5"),
    "qwen3_5-moe": Qwen3NextArgs(**{**_BASE, "ffn_dim": 32}, **_MOE, variant="qwen3_5"),  # ffn_dim: the experts'

}

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init: zero-centred norms near 0 (scales near 1), the gated norm near 1, decays and
    router logits of order 1, so a wrongly mapped tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif "norm" in name:
                p.copy_(0.2 * noise)
            elif "A_log" in name or "dt_bias" in name or "mlp.gate.weight" in name:
                p.copy_(0.4 * noise)
            else:
                p.copy_(0.05 * noise)


def _pair(shape: str, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    args = SHAPES[shape]
    hf = hf_model("qwen3_next", args)
    _randomise(hf, seed)
    return hf, import_hf_model("qwen3_next", hf, args)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_imported_give_hf_logits(shape):
    args = SHAPES[shape]
    hf, ours = _pair(shape, seed=0)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert hf.config.layer_types == ["linear_attention", "full_attention"] * 2
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 1)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("shape", ["qwen3_next-moe", "qwen3_5-dense"])
def test_packed_documents_give_each_documents_hf_logits_alone(shape):
    hf, ours = _pair(shape, seed=2)
    tokens = random_tokens(SHAPES[shape].vocab_size, SEQ_LEN, 3, batch=1)
    cut = 37  # inside the first chunk of the delta rule: the state and the convolution restart mid-chunk
    documents = Documents.from_starts([np.array([0, cut])], SEQ_LEN, reset_positions=True)
    with torch.no_grad():
        packed = ours(tokens, documents=documents)
    for lo, hi in ((0, cut), (cut, SEQ_LEN)):
        alone = logits(hf, tokens[:, lo:hi])
        assert (packed[:, lo:hi] - alone).abs().max().item() < TOL
    whole = logits(hf, tokens)
    assert (packed[:, cut:] - whole[:, cut:]).abs().max().item() > 100 * TOL  # the boundary does matter


def test_the_first_step_loss_with_the_aux_term_equals_transformers():
    hf, ours = _pair("qwen3_next-moe", seed=11)
    tokens = random_tokens(SHAPES["qwen3_next-moe"].vocab_size, SEQ_LEN, 12)
    with torch.no_grad():
        out = hf(tokens, labels=tokens, output_router_logits=True)
        ours_logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(ours_logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(ours.load_balancing_loss().item() - out.aux_loss.item()) <= LOSS_RTOL * out.aux_loss.item()
    assert abs((ce + ours.auxiliary_loss()).item() - out.loss.item()) <= LOSS_RTOL * out.loss.item()


def _ours_loss(model, tokens, labels):
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    aux = model.auxiliary_loss()
    return loss if aux is None else loss + aux


def _hf_loss(model, tokens, labels):
    moe = getattr(model.config, "num_experts", 0)
    out = model(tokens, output_router_logits=True) if moe else model(tokens)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    return loss + model.router_aux_loss_coef * out.aux_loss if moe else loss


@pytest.mark.parametrize("shape", ["qwen3_next-moe", "qwen3_5-dense"])
def test_twenty_steps_from_imported_weights_track_a_transformers_training_loop(shape):
    hf, ours = _pair(shape, seed=3)
    hf.train()
    ours.train()
    batches = memorisable_batches(SHAPES[shape].vocab_size, 24, 20, batch=2)
    # lr 1e-3, 2 sequences a step: the gradients agree to 2e-6 relative and Adam's normalised steps carry that apart;
    # measured at most 5.6e-7 (dense) and 5.1e-7 (MoE) relative over the 20 steps with 1 or 2 threads (at lr 3e-3
    # and 4 sequences: up to 9e-5).
    ours_losses = adamw_steps(ours, batches, _ours_loss, lr=1e-3)
    hf_losses = adamw_steps(hf, batches, _hf_loss, lr=1e-3)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


@pytest.mark.parametrize("shape", ["qwen3_next-moe", "qwen3_5-moe"])
def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(tmp_path, shape):
    args = SHAPES[shape]
    hf, _ = _pair(shape, seed=9)
    weights, ours, back = round_trip_hf_dir(hf, "qwen3_next", tmp_path)
    assert weights.format == "hf" and weights.args == args
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 10)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    assert back.config.model_type == hf.config.model_type
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_a_qwen3_5_checkpoint_reads_its_language_model_and_leaves_the_vision_tower():
    args = SHAPES["qwen3_5-dense"]
    hf, _ = _pair("qwen3_5-dense", seed=4)
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.state_dict().items()}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    state["mtp.fc.weight"] = torch.zeros(2, 2)
    config = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": hf.config.to_dict()}
    read = get_spec("qwen3_next").hf.args_from_config(config)
    assert read == args
    ours = build_model(args)
    ours.load_state_dict(get_spec("qwen3_next").hf.from_hf(state, args), strict=True)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 5)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL

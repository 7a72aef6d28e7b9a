"""Qwen3, Qwen2.5, Qwen3-MoE and DeepSeek-V3 against Hugging Face transformers (fp32, CPU), through the registry's
adapters: the same logits after import, losses that track a plain transformers training loop from the imported
weights, and a Hugging Face directory that reads by its model_type and exports back loadable by the Auto classes;
then what one family alone has (exported dense weights, tied embeddings, q/k norms, the MoE aux loss, fp8
checkpoints, YaRN flavors)."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    save_hf_dir,
    use_reference_kernels,
)

from titan_npu.checkpoint.formats import read_weights
from titan_npu.config.schema import ModelConfig
from titan_npu.errors import CheckpointError
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.deepseek_v3.args import DeepSeekArgs
from titan_npu.models.moe_decoder.args import MoEDecoderArgs
from titan_npu.models.registry import build_model, build_model_args, get_spec, spec_for_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of unit scale)
STEP_RTOL = 1e-4  # each training step's loss, relative (measured: at most 7e-6 for Qwen3-MoE, 2e-6 for DeepSeek-V3)
LOSS_RTOL = 1e-5  # Qwen3-MoE's first-step loss with its aux term, relative

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


# --- the families' shapes -----------------------------------------------------------------------------------------

_QWEN3 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=160, ffn_dim=96, norm_eps=1e-6,
              rope_theta=1000000.0, max_seq_len=128, qk_norm=True, family="qwen3")
_QWEN2 = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_dim=96, norm_eps=1e-6,
              rope_theta=1000000.0, max_seq_len=128, qkv_bias=True, family="qwen2")
# Non-default head_dim (32 with dim 64 / 4 heads = 16), GQA, tied and untied.
QWEN = {
    "qwen3-tied": DecoderArgs(**_QWEN3, tie_embeddings=True),
    "qwen3-untied": DecoderArgs(**_QWEN3),
    "qwen3-mha-head16": DecoderArgs(**{**_QWEN3, "n_kv_heads": 4, "head_dim": None}),
    "qwen2-tied": DecoderArgs(**_QWEN2, tie_embeddings=True),
    "qwen2-untied": DecoderArgs(**_QWEN2),
}

_MOE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=160, ffn_dim=96, norm_eps=1e-6,
            rope_theta=1000000.0, max_seq_len=128, qk_norm=True, family="qwen3_moe", n_experts=8, top_k=2,
            moe_ffn_dim=32, router_aux_loss_coef=0.02)
QWEN3_MOE = {
    "all-moe-normalised": MoEDecoderArgs(**_MOE),
    # Layer 1 dense by mlp_only_layers, layer 0 by the sparse step (only odd ids are MoE), top-k not renormalised.
    "mixed-unnormalised": MoEDecoderArgs(**{**_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2,
                                            "n_layers": 4, "mlp_only_layers": [3]}),
}

_DEEPSEEK = dict(dim=64, n_layers=3, n_heads=4, vocab_size=160, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
                 max_seq_len=128, family="deepseek_v3", kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=12, n_experts=8, top_k=2, moe_ffn_dim=24, n_shared_experts=1, n_groups=4, topk_groups=2,
                 route_scale=2.5, first_k_dense=1)
DEEPSEEK_V3 = {
    # A low-rank query, YaRN RoPE whose mscale and mscale_all_dim differ (both the cos/sin factor and the softmax
    # scale move), top-k weights renormalised.
    "q-lora-yarn": DeepSeekArgs(**_DEEPSEEK, q_lora_rank=24, yarn_factor=4.0, yarn_original_seq_len=32,
                                yarn_mscale=1.0, yarn_mscale_all_dim=0.8),
    # A plain query projection, plain RoPE, weights not renormalised, 2 shared experts.
    "plain-q": DeepSeekArgs(**{**_DEEPSEEK, "n_shared_experts": 2, "route_scale": 1.0}, q_lora_rank=0,
                            norm_topk_prob=False),
}


def _randomise_moe(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init (norms near 1, router logits of order 1), so a wrong mapping shows."""
    randomise(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate." in name:
                p.mul_(0.3 / 0.08)


def _randomise_deepseek(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init (norms near 1, router logits of order 1, a nonzero score bias), so a wrong
    mapping shows."""
    randomise(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.3 / 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _cross_entropy(model, tokens, labels):
    out = logits(model, tokens) if not torch.is_grad_enabled() else model(tokens)
    out = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten())


def _moe_loss(model, tokens, labels):
    """Cross entropy + the aux term, as our trainer optimises it."""
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()) + model.auxiliary_loss()


def _moe_hf_loss(model, tokens, labels):
    """transformers' cross entropy + coef x its aux loss."""
    out = model(tokens, output_router_logits=True)
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) \
        + model.router_aux_loss_coef * out.aux_loss


@dataclass(frozen=True)
class Family:
    """How one family is held to transformers: its shapes, weights and the settings of each shared check."""

    shapes: dict[str, Any]
    seq_len: int
    randomise: Callable[[torch.nn.Module, int], None]
    pass_tie: bool  # the import is told the HF model's tie_word_embeddings
    steps: int  # training steps compared
    batch: int  # sequences per training step
    ours_loss: Callable
    hf_loss: Callable
    trained: tuple  # shapes whose training loop runs (pytest.param for the slow ones)
    directory: tuple[str, ...]  # shapes whose HF directory round trip runs
    read_back: Callable[[Any, Any], bool]  # the args read from the directory are the model's
    exported_keys: tuple[str, ...]  # HF names the export must hold
    config_fields: tuple[str, ...]  # config.json fields the exported directory must carry over
    fields_may_be_absent: bool = False  # a field absent from both configs counts as the same


FAMILIES = {
    "qwen": Family(
        QWEN, 48, randomise, pass_tie=True, steps=30, batch=4, ours_loss=_cross_entropy, hf_loss=_cross_entropy,
        trained=("qwen3-tied", "qwen2-untied"), directory=("qwen3-tied", "qwen2-untied"),
        read_back=lambda read, args: read.family == args.family and (read.head_dim, read.tie_embeddings) == (
            args.head_dim, args.tie_embeddings),
        exported_keys=(),
        config_fields=("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "intermediate_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps"),
        fields_may_be_absent=True),
    "qwen3_moe": Family(
        QWEN3_MOE, 32, _randomise_moe, pass_tie=False, steps=20, batch=4, ours_loss=_moe_loss, hf_loss=_moe_hf_loss,
        # The mixed shape's logits are checked by default; its 20-step loop runs with -m slow.
        trained=("all-moe-normalised", pytest.param("mixed-unnormalised", marks=pytest.mark.slow)),
        directory=("mixed-unnormalised",), read_back=lambda read, args: read == args,
        exported_keys=("model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.gate.weight"),
        config_fields=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                       "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "head_dim")),
    "deepseek_v3": Family(
        DEEPSEEK_V3, 32, _randomise_deepseek, pass_tie=False, steps=20, batch=2, ours_loss=_cross_entropy,
        hf_loss=_cross_entropy, trained=("q-lora-yarn", pytest.param("plain-q", marks=pytest.mark.slow)),
        directory=("q-lora-yarn",), read_back=lambda read, args: read == args,
        exported_keys=("model.layers.2.mlp.experts.7.down_proj.weight",
                       "model.layers.1.mlp.gate.e_score_correction_bias"),
        config_fields=("q_lora_rank", "kv_lora_rank", "n_group", "topk_group", "routed_scaling_factor",
                       "first_k_dense_replace", "n_shared_experts", "v_head_dim")),
}


def _cases(pick: Callable[[Family], tuple]) -> list:
    """pytest params (family, shape) of the shapes `pick` chooses from each family, marks kept, ids by shape."""
    out = []
    for name, family in FAMILIES.items():
        for shape in pick(family):
            marks = shape.marks if hasattr(shape, "marks") else ()
            shape = shape.values[0] if hasattr(shape, "values") else shape
            out.append(pytest.param(name, shape, marks=marks, id=shape))
    return out


def _import(name: str, hf: torch.nn.Module, args: Any) -> torch.nn.Module:
    tie = {"tie_word_embeddings": args.tie_embeddings} if FAMILIES[name].pass_tie else {}
    return import_hf_model(args.family, hf, args, **tie)


# --- every family -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "shape"), _cases(lambda f: tuple(f.shapes)))
def test_hf_weights_imported_give_hf_logits(name, shape):
    family = FAMILIES[name]
    args = family.shapes[shape]
    hf = hf_model(args.family, args)
    family.randomise(hf, 0)
    ours = _import(name, hf, args)
    tokens = random_tokens(args.vocab_size, family.seq_len, 1)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize(("name", "shape"), _cases(lambda f: f.trained))
def test_training_steps_from_imported_weights_track_a_transformers_training_loop(name, shape):
    family = FAMILIES[name]
    args = family.shapes[shape]
    hf = hf_model(args.family, args).train()
    family.randomise(hf, 7)
    ours = _import(name, hf, args).train()
    batches = memorisable_batches(args.vocab_size, family.seq_len, family.steps, batch=family.batch)
    ours_losses = adamw_steps(ours, batches, family.ours_loss)
    hf_losses = adamw_steps(hf, batches, family.hf_loss)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


@pytest.mark.parametrize(("name", "shape"), _cases(lambda f: f.directory))
def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(name, shape, tmp_path):
    family = FAMILIES[name]
    args = family.shapes[shape]
    hf = hf_model(args.family, args)
    family.randomise(hf, 9)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert spec_for_hf_config(config).name == args.family
    weights = read_weights(tmp_path / "hf")  # MoE: per-expert tensors on disk
    assert weights.format == "hf" and family.read_back(weights.args, args)
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    ours.tie_weights()
    tokens = random_tokens(args.vocab_size, family.seq_len, 10)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    # Back to a Hugging Face directory, loaded by the Auto class with the original model_type and fields.
    spec = get_spec(args.family)
    exported = spec.hf.to_hf(ours.state_dict(), weights.args)
    assert all(key in exported for key in family.exported_keys)
    save_hf_dir(exported, spec.hf.config(weights.args), tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    for field in family.config_fields:
        if family.fields_may_be_absent:
            assert getattr(back.config, field, None) == getattr(hf.config, field, None), field
        else:
            assert getattr(back.config, field) == getattr(hf.config, field), field
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize(("name", "shape", "moe_layers"), [
    pytest.param("qwen3_moe", "mixed-unnormalised", [1], id="mixed-unnormalised"),
    pytest.param("deepseek_v3", "q-lora-yarn", [1, 2], id="q-lora-yarn"),
    pytest.param("deepseek_v3", "plain-q", [1, 2], id="plain-q"),
])
def test_the_model_counts_its_parameters_and_builds_the_layers_transformers_does(name, shape, moe_layers):
    args = FAMILIES[name].shapes[shape]
    ours = build_model(args)
    assert sum(p.numel() for p in ours.parameters()) == args.num_params()
    hf = hf_model(args.family, args)
    assert sum(p.numel() for p in hf.parameters()) == args.num_params()
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe == [i for i in range(args.n_layers) if args.is_moe_layer(i)] == moe_layers


# --- dense Qwen: export, tied embeddings, q/k norms ----------------------------------------------------------------


@pytest.mark.parametrize("shape", list(QWEN))
def test_our_weights_exported_give_our_logits_in_hf(shape):
    args = QWEN[shape]
    torch.manual_seed(2)
    ours = build_model(args)
    ours.init_weights(seed=2)
    randomise(ours, seed=3)
    hf = hf_model(args.family, args)
    missing, unexpected = hf.load_state_dict(get_spec(args.family).hf.to_hf(ours.state_dict(), args), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if args.tie_embeddings else [])
    hf.tie_weights()
    tokens = random_tokens(args.vocab_size, FAMILIES["qwen"].seq_len, 4)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_a_tied_model_holds_one_matrix_for_embedding_and_output():
    ours = build_model(QWEN["qwen3-tied"])
    assert ours.output.weight is ours.tok_embeddings.weight
    names = [n for n, _ in ours.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert sum(p.numel() for p in ours.parameters()) == QWEN["qwen3-tied"].num_params()
    assert sum(p.numel() for p in build_model(QWEN["qwen3-untied"]).parameters()) == \
        QWEN["qwen3-untied"].num_params()


def test_the_parity_check_would_catch_unpermuted_q_k_norms():
    args = QWEN["qwen3-untied"]
    hf = hf_model(args.family, args)
    randomise(hf, seed=5)
    ours = import_hf_model(args.family, hf, args, tie_word_embeddings=args.tie_embeddings)
    with torch.no_grad():
        for layer in ours.layers.values():  # the HF channel order, as a mapping without the permutation would give
            i = int(layer.layer_id)
            layer.attention.q_norm.weight.copy_(hf.model.layers[i].self_attn.q_norm.weight)
    tokens = random_tokens(args.vocab_size, FAMILIES["qwen"].seq_len, 6)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() > 100 * TOL


# --- Qwen3-MoE: the aux loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(QWEN3_MOE))
def test_the_first_step_loss_with_the_aux_term_equals_transformers(shape):
    args = QWEN3_MOE[shape]
    hf = hf_model("qwen3_moe", args)
    _randomise_moe(hf, seed=11)
    ours = import_hf_model("qwen3_moe", hf, args)
    tokens = random_tokens(args.vocab_size, FAMILIES["qwen3_moe"].seq_len, 12)
    with torch.no_grad():
        out = hf(tokens, labels=tokens, output_router_logits=True)  # shifts the labels itself
        ours_logits = ours(tokens)
    ce = torch.nn.functional.cross_entropy(ours_logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(ours.load_balancing_loss().item() - out.aux_loss.item()) <= LOSS_RTOL * out.aux_loss.item()
    total = (ce + ours.auxiliary_loss()).item()
    assert abs(total - out.loss.item()) <= LOSS_RTOL * out.loss.item()
    assert args.router_aux_loss_coef * out.aux_loss.item() > 100 * LOSS_RTOL * out.loss.item()  # the aux term counts


# --- DeepSeek-V3: fp8 checkpoints, published flavors ---------------------------------------------------------------


def _fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight quantised to fp8 e4m3 with one scale per block x block tile (the published checkpoint's format)."""
    rows, cols = (-(-n // block) for n in weight.shape)
    padded = torch.nn.functional.pad(weight, (0, cols * block - weight.shape[1], 0, rows * block - weight.shape[0]))
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    quant = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * block, cols * block)
    return quant[:weight.shape[0], :weight.shape[1]].contiguous(), scale


def test_an_fp8_checkpoint_with_block_scales_imports_dequantised(tmp_path):
    args = DeepSeekArgs(**{**_DEEPSEEK, "dim": 160, "n_layers": 2}, q_lora_rank=0)  # 160: a partial 128-block
    hf = hf_model("deepseek_v3", args)
    _randomise_deepseek(hf, seed=3)
    ours = import_hf_model("deepseek_v3", hf, args)
    state = {k: v for k, v in get_spec("deepseek_v3").hf.to_hf(ours.state_dict(), args).items()}
    quantised, expected = {}, {}
    for key, tensor in state.items():
        if key.endswith("proj.weight") and tensor.dim() == 2:
            quantised[key], quantised[f"{key}_scale_inv"] = _fp8_blocks(tensor)
            blocks = quantised[f"{key}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            expected[key] = quantised[key].float() * blocks[:tensor.shape[0], :tensor.shape[1]]
        else:
            quantised[key] = expected[key] = tensor
    config = {**get_spec("deepseek_v3").hf.config(args),
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    save_hf_dir(quantised, config, tmp_path / "fp8")
    weights = read_weights(tmp_path / "fp8")
    want = get_spec("deepseek_v3").hf.from_hf(expected, args)
    assert weights.state_dict.keys() == want.keys()
    for key, tensor in want.items():
        assert weights.state_dict[key].dtype == torch.float32 and torch.equal(weights.state_dict[key], tensor), key
    # The dequantised weights are the original within fp8's rounding (3 mantissa bits).
    w = weights.state_dict["layers.0.attention.wq.weight"]
    original = state["model.layers.0.self_attn.q_proj.weight"]
    assert (w - original).abs().max() <= 0.07 * original.abs().max()


@pytest.mark.parametrize("flavor", ["debug", "16B", "236B", "671B"])
def test_a_published_config_reads_back_as_its_flavor_yarn_included(flavor):
    args = build_model_args(ModelConfig(name="deepseek_v3", flavor=flavor))
    back = get_spec("deepseek_v3").hf.args_from_config(get_spec("deepseek_v3").hf.config(args))
    assert back == args and back.flavor == flavor


def test_the_shard_wise_reader_refuses_fp8_in_one_line():
    args = DEEPSEEK_V3["plain-q"]
    with pytest.raises(CheckpointError, match="dequantise the checkpoint first with `titan-npu import`") as error:
        get_spec("deepseek_v3").hf.from_hf_layout("layers.0.attention.wq.weight",
                                                  torch.zeros(4, 4, dtype=torch.float8_e4m3fn), args)
    assert "\n" not in str(error.value)

"""Map dense-decoder weights between our (Meta's) names and Hugging Face's (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM share one layout).

Hugging Face checkpoints store the rows of every q/k head permuted: HF's rotary embedding rotates the two halves of a
head (rotate_half), ours rotates interleaved pairs (2i, 2i+1). to_hf / from_hf apply that permutation to wq/wk (per
query head for wq, per key/value head for wk), to their biases (Qwen2), and to the per-head q/k norm weights (Qwen3,
applied before the rotation, so their channels follow the same order), so both models compute the same function.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError, ConfigError
from titan_npu.models.decoder.args import (
    ROPE_SCALING_HIGH_FREQ_FACTOR,
    ROPE_SCALING_LOW_FREQ_FACTOR,
    ROPE_SCALING_ORIGINAL_CONTEXT,
    DecoderArgs,
)

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Inside layer N: ours after "layers.N." -> Hugging Face after "model.layers.N.".
PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in TOP_LEVEL.items()}
PER_LAYER_FROM_HF = {hf: ours for ours, hf in PER_LAYER.items()}
OUR_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some Hugging Face checkpoints carry; the model recomputes them.
HF_IGNORED_SUFFIX = "self_attn.rotary_emb.inv_freq"
# Our names whose rows (or channels) are permuted between the two RoPE layouts -> whose head count applies.
_ROPE_PERMUTED = {"attention.wq.weight": "q", "attention.wq.bias": "q", "attention.wk.weight": "kv",
                  "attention.wk.bias": "kv", "attention.q_norm.weight": "norm", "attention.k_norm.weight": "norm"}


def hf_name(key: str) -> str:
    """Our parameter name -> the Hugging Face name ('layers.3.attention.wq.weight' -> 'model.layers.3....')."""
    return mapped_hf_name(key, TOP_LEVEL, PER_LAYER,
                          "state dict key '{key}' is not a parameter of this model; export only its weights")


def mapped_hf_name(key: str, top_level: dict[str, str], per_layer: dict[str, str], unknown: str) -> str:
    """Our name -> the Hugging Face one by a family's tables: `top_level` names, and `per_layer` ones under
    model.layers.N; any other name a CheckpointError of `unknown` (formatted with the key)."""
    if key in top_level:
        return top_level[key]
    match = OUR_LAYER_KEY.fullmatch(key)
    if match is None or match.group(2) not in per_layer:
        raise CheckpointError(unknown.format(key=key))
    return f"model.layers.{match.group(1)}.{per_layer[match.group(2)]}"


def our_name(hf_key: str) -> str | None:
    """A Hugging Face name -> ours; None for a buffer the model recomputes."""
    if hf_key in TOP_LEVEL_FROM_HF:
        return TOP_LEVEL_FROM_HF[hf_key]
    match = HF_LAYER_KEY.fullmatch(hf_key)
    if match is not None and match.group(2) == HF_IGNORED_SUFFIX:
        return None
    if match is None or match.group(2) not in PER_LAYER_FROM_HF:
        raise CheckpointError(f"Hugging Face key '{hf_key}' has no counterpart in this model; is the checkpoint "
                              "of the model_type its config.json names?")
    return f"layers.{match.group(1)}.{PER_LAYER_FROM_HF[match.group(2)]}"


def to_hf(state_dict: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    """Rename our state dict to Hugging Face keys, permuting q/k rows into HF's RoPE layout; a tied model's
    output projection is left out (Hugging Face ties lm_head to the embedding on load)."""
    hf = {}
    for key, tensor in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue
        hf[hf_name(key)] = to_hf_layout(key, tensor, args)
    return hf


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: DecoderArgs, *, tie_word_embeddings: bool = False
            ) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to ours, permuting q/k back to our RoPE layout.

    A tied checkpoint (config.json's tie_word_embeddings) gives the output projection the embedding's values: the
    same tensor for a tied model, a copy for an untied one (which then trains them apart).
    """
    ours = {}
    for key, tensor in hf_state_dict.items():
        name = our_name(key)
        if name is not None:
            ours[name] = _permute(name, tensor, args, to_hf=False, label=key)
    if tie_word_embeddings and "tok_embeddings.weight" in ours:
        embedding = ours["tok_embeddings.weight"]
        ours["output.weight"] = embedding if args.tie_embeddings else embedding.clone()
    return ours


def to_hf_layout(key: str, tensor: torch.Tensor, args: DecoderArgs) -> torch.Tensor:
    """Our tensor `key` in Hugging Face's row order (only q/k rows and norms differ)."""
    return _permute(key, tensor, args, to_hf=True)


def from_hf_layout(key: str, tensor: torch.Tensor, args: DecoderArgs) -> torch.Tensor:
    """A Hugging Face tensor stored under our name `key`, or a run of whole heads of its rows (any of its
    columns: a shard read on its own), in our row order."""
    return _permute(key, tensor, args, to_hf=False, whole_heads=True)


def _permute(key: str, tensor: torch.Tensor, args: DecoderArgs, to_hf: bool, label: str = "",
             whole_heads: bool = False) -> torch.Tensor:
    """`key`'s tensor in the other layout; `label` names it in errors (its name in the source, default `key`);
    whole_heads accepts any run of whole heads of the rows (and of the columns) instead of the full tensor."""
    match = OUR_LAYER_KEY.fullmatch(key)
    which = _ROPE_PERMUTED.get(match.group(2)) if match is not None else None
    if which is None:
        return tensor
    heads = {"q": args.n_heads, "kv": args.n_kv_heads, "norm": 1}[which]
    is_projection = match.group(2) in ("attention.wq.weight", "attention.wk.weight")
    expected = (heads * args.head_dim, args.dim) if is_projection else (heads * args.head_dim,)
    shape = tuple(tensor.shape)
    fits = shape == expected
    if whole_heads and len(shape) == len(expected) and shape[0] % args.head_dim == 0:
        fits = all(n <= limit for n, limit in zip(shape, expected))
        heads = shape[0] // args.head_dim
    if not fits:
        raise CheckpointError(
            f"'{label or key}' has shape {shape} but the model expects {expected}"
            f"{' (or whole heads of its rows)' if whole_heads else ''}; "
            f"the checkpoint's config does not match the model config"
        )
    half = args.head_dim // 2
    rest = tensor.shape[1:]
    # Per head, ours pairs rows (2i, 2i+1); HF's halves are rows (i, i + head_dim/2).
    if to_hf:
        return tensor.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(tensor.shape)
    return tensor.reshape(heads, 2, half, *rest).transpose(1, 2).reshape(tensor.shape)


# ---------------------------------------------------------------------------------------------------- config.json


def hf_config(args: DecoderArgs, model_type: str, architecture: str) -> dict[str, Any]:
    """config.json of the Hugging Face model `architecture` with these shapes (tokenizer ids and dtype are the
    caller's); the fields every decoder family shares."""
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": args.qkv_bias,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
    }
    if args.rope_scaling_factor is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": ROPE_SCALING_LOW_FREQ_FACTOR,
            "high_freq_factor": ROPE_SCALING_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": ROPE_SCALING_ORIGINAL_CONTEXT,
        }
    return config


def args_from_hf_config(config: dict[str, Any], *, model_type: str, family: str, qkv_bias: bool = False,
                        qk_norm: bool = False) -> DecoderArgs:
    """DecoderArgs of `family` from a Hugging Face config.json of `model_type` (transformers 4 `rope_scaling` or 5
    `rope_parameters`), refusing what the model cannot compute (other activations, MLP biases, sliding windows,
    RoPE scalings other than Llama 3.1's). The flavor is the caller's to match."""
    found = config.get("model_type", model_type)
    if found != model_type:
        raise CheckpointError(f"config.json model_type='{found}' is not '{model_type}'")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is it a Hugging Face {model_type} config?")
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias", qkv_bias)) != qkv_bias,
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "use_sliding_window": bool(config.get("use_sliding_window", False)),
    }
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise CheckpointError(f"config.json has {bad}; {model_type} here means a silu MLP without biases, "
                              f"{'biases' if qkv_bias else 'no biases'} on q/k/v and full causal attention")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    fields = dict(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling_factor=_rope_scaling_factor(rope),
        max_seq_len=config.get("max_position_embeddings", 2048),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        family=family,
    )
    try:
        return DecoderArgs(**fields)
    except ConfigError as e:
        raise CheckpointError(f"config.json describes a model that cannot be built: {e}") from e


def _rope_scaling_factor(rope: dict[str, Any]) -> float | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise CheckpointError(f"config.json rope type '{rope_type}' is not supported (only default and llama3); "
                              "remove rope_scaling from config.json to train at the model's native context")
    expected = {
        "low_freq_factor": ROPE_SCALING_LOW_FREQ_FACTOR,
        "high_freq_factor": ROPE_SCALING_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": ROPE_SCALING_ORIGINAL_CONTEXT,
    }
    differing = {k: rope.get(k) for k, v in expected.items() if rope.get(k, v) != v}
    if differing:
        raise CheckpointError(
            f"config.json llama3 rope scaling has {differing}; only Llama 3.1's {expected} is supported"
        )
    return float(rope["factor"])

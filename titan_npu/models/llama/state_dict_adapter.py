"""Map Llama weights between our (Meta's) names and Hugging Face LlamaForCausalLM, and read Meta checkpoints.

Hugging Face checkpoints store wq/wk with the rows of every head permuted: HF's rotary embedding rotates the
two halves of a head (rotate_half), Meta's rotates interleaved pairs (2i, 2i+1). to_hf / from_hf apply that
permutation (per query head for wq, per key/value head for wk), so both models compute the same function.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.llama.args import (
    FLAVORS,
    ROPE_SCALING_HIGH_FREQ_FACTOR,
    ROPE_SCALING_LOW_FREQ_FACTOR,
    ROPE_SCALING_ORIGINAL_CONTEXT,
    LlamaArgs,
    ffn_hidden_dim,
)
from titan_npu.models.llama.sharding import LAYER_SHARD_DIM, ROOT_SHARD_DIM

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Inside layer N: ours after "layers.N." -> Hugging Face after "model.layers.N.".
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL.items()}
_PER_LAYER_FROM_HF = {hf: ours for ours, hf in _PER_LAYER.items()}
_OUR_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some Hugging Face checkpoints carry; the model recomputes them.
_HF_IGNORED_SUFFIX = "self_attn.rotary_emb.inv_freq"


def to_hf(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Rename our state dict to Hugging Face LlamaForCausalLM keys, permuting wq/wk into HF's RoPE layout."""
    hf = {}
    for key, tensor in state_dict.items():
        if key in _TOP_LEVEL:
            hf[_TOP_LEVEL[key]] = tensor
            continue
        match = _OUR_LAYER_KEY.fullmatch(key)
        if match is None or match.group(2) not in _PER_LAYER:
            raise CheckpointError(f"state dict key '{key}' is not a Llama parameter; export only the model's weights")
        layer, name = match.groups()
        if name == "attention.wq.weight":
            tensor = _meta_to_hf_rope_rows(tensor, args.n_heads, args, key)
        elif name == "attention.wk.weight":
            tensor = _meta_to_hf_rope_rows(tensor, args.n_kv_heads, args, key)
        hf[f"model.layers.{layer}.{_PER_LAYER[name]}"] = tensor
    return hf


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: LlamaArgs, *, tie_word_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face LlamaForCausalLM state dict to ours, permuting q/k_proj back to Meta's RoPE layout.

    tie_word_embeddings=True (config.json says so, e.g. Llama 3.2 1B) copies the embedding into our untied output.
    """
    ours = {}
    for key, tensor in hf_state_dict.items():
        if key in _TOP_LEVEL_FROM_HF:
            ours[_TOP_LEVEL_FROM_HF[key]] = tensor
            continue
        match = _HF_LAYER_KEY.fullmatch(key)
        if match is not None and match.group(2) == _HF_IGNORED_SUFFIX:
            continue
        if match is None or match.group(2) not in _PER_LAYER_FROM_HF:
            raise CheckpointError(
                f"Hugging Face key '{key}' has no Llama counterpart; is this a LlamaForCausalLM checkpoint?"
            )
        layer, hf_name = match.groups()
        name = _PER_LAYER_FROM_HF[hf_name]
        our_key = f"layers.{layer}.{name}"
        if name == "attention.wq.weight":
            tensor = _hf_to_meta_rope_rows(tensor, args.n_heads, args, key)
        elif name == "attention.wk.weight":
            tensor = _hf_to_meta_rope_rows(tensor, args.n_kv_heads, args, key)
        ours[our_key] = tensor
    if tie_word_embeddings and "output.weight" not in ours and "tok_embeddings.weight" in ours:
        ours["output.weight"] = ours["tok_embeddings.weight"].clone()
    return ours


def from_meta(
    consolidated: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]], args: LlamaArgs | None = None
) -> dict[str, torch.Tensor]:
    """Our state dict from Meta's consolidated.*.pth (names are already ours; rope.freqs is dropped).

    A list is the model-parallel shards consolidated.00, .01, ... in order; merging them needs args (family).
    """
    shards = [consolidated] if isinstance(consolidated, dict) else list(consolidated)
    if not shards:
        raise CheckpointError("no Meta checkpoint shards given; pass the consolidated.*.pth state dicts in order")
    if len(shards) > 1 and args is None:
        raise CheckpointError(f"merging {len(shards)} Meta shards needs the model args (Llama 2 and 3 split differ)")
    merged = {}
    for key in shards[0]:
        if key == "rope.freqs":
            continue
        dim = _meta_shard_dim(key, args)
        parts = [shard[key] for shard in shards]
        merged[key] = parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)
    return merged


def hf_config(args: LlamaArgs) -> dict[str, Any]:
    """config.json for a Hugging Face LlamaForCausalLM with these shapes (tokenizer ids and dtype are the caller's)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
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


def args_from_hf_config(config: dict[str, Any]) -> LlamaArgs:
    """LlamaArgs from a Hugging Face Llama config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`)."""
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(f"config.json model_type='{model_type}' is not 'llama'; only Llama checkpoints import")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is it a Hugging Face Llama config?")
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
    }
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise CheckpointError(f"config.json has {bad}; Llama here means silu MLP without biases")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise CheckpointError(
            f"config.json head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={dim}; "
            f"this model requires head_dim = hidden_size / num_attention_heads"
        )
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    args = LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling_factor=_rope_scaling_factor(rope),
        max_seq_len=config.get("max_position_embeddings", 2048),
        family="llama3" if config["vocab_size"] >= 128000 or rope_theta >= 500000 else "llama2",
    )
    args.flavor = _matching_flavor(args)
    return args


def _rope_scaling_factor(rope: dict[str, Any]) -> float | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise CheckpointError(f"config.json rope type '{rope_type}' is not supported (only default and llama3)")
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


def _matching_flavor(args: LlamaArgs) -> str:
    shape = ("dim", "n_layers", "n_heads", "vocab_size")
    for flavor, preset in FLAVORS[args.family].items():
        ffn = ffn_hidden_dim(preset["dim"], preset["multiple_of"], preset["ffn_dim_multiplier"])
        n_kv_heads = preset.get("n_kv_heads", preset["n_heads"])
        same_shape = all(preset[k] == getattr(args, k) for k in shape)
        if same_shape and n_kv_heads == args.n_kv_heads and ffn == args.ffn_dim:
            return flavor
    return "custom"


def _check_qk_shape(tensor: torch.Tensor, n_heads: int, args: LlamaArgs, key: str) -> None:
    expected = (n_heads * args.head_dim, args.dim)
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"'{key}' has shape {tuple(tensor.shape)} but the model expects {expected}; "
            f"the checkpoint's config does not match the model config"
        )


def _meta_to_hf_rope_rows(w: torch.Tensor, n_heads: int, args: LlamaArgs, key: str) -> torch.Tensor:
    # Per head, rows (2i, 2i+1) -> (i, i + head_dim/2): interleaved pairs become the two halves.
    _check_qk_shape(w, n_heads, args, key)
    return w.view(n_heads, args.head_dim // 2, 2, args.dim).transpose(1, 2).reshape(w.shape)


def _hf_to_meta_rope_rows(w: torch.Tensor, n_heads: int, args: LlamaArgs, key: str) -> torch.Tensor:
    _check_qk_shape(w, n_heads, args, key)
    return w.view(n_heads, 2, args.head_dim // 2, args.dim).transpose(1, 2).reshape(w.shape)


def _meta_shard_dim(key: str, args: LlamaArgs | None) -> int | None:
    """The dim Meta's model-parallel shards split `key` along (models/llama/sharding.py), None = replicated."""
    if key == "tok_embeddings.weight" and (args is None or args.family != "llama3"):
        # Llama 2's ParallelEmbedding splits the embedding by channel; Llama 3 by vocabulary, as ours is.
        return 1
    if key in ROOT_SHARD_DIM:
        return ROOT_SHARD_DIM[key]
    match = _OUR_LAYER_KEY.fullmatch(key)
    if match is None or match.group(2) not in LAYER_SHARD_DIM:
        raise CheckpointError(f"Meta checkpoint key '{key}' is not a Llama parameter; is this a consolidated.pth?")
    return LAYER_SHARD_DIM[match.group(2)]

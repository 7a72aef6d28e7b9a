"""Meta's consolidated Llama checkpoints (params.json and consolidated.*.pth): our names already, split over
model-parallel shards along the dims of models/decoder/sharding.py."""

from __future__ import annotations

from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder.args import DecoderArgs, ffn_hidden_dim
from titan_npu.models.decoder.hf import OUR_LAYER_KEY
from titan_npu.models.decoder.sharding import LAYER_SHARD_DIM, ROOT_SHARD_DIM


def from_meta(
    consolidated: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]], args: DecoderArgs | None = None
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


def args_from_meta_params(params: dict[str, Any], shard: dict[str, torch.Tensor], n_shards: int = 1
                          ) -> DecoderArgs:
    """Llama's args from Meta's params.json; vocab size and FFN size are read off the tensors when params omit them."""
    try:
        dim, n_layers, n_heads = int(params["dim"]), int(params["n_layers"]), int(params["n_heads"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"params.json lacks {e}; is it Meta's Llama params.json?") from e
    vocab = int(params.get("vocab_size") or -1)
    if vocab <= 0:
        # Llama 2's params.json says -1 (the tokenizer decides); its shards split the embedding by channel, so
        # every shard has all the rows.
        vocab = shard["tok_embeddings.weight"].shape[0]
    w1 = shard.get("layers.0.feed_forward.w1.weight")
    ffn_dim = w1.shape[0] * n_shards if w1 is not None else ffn_hidden_dim(
        dim, int(params.get("multiple_of", 256)), params.get("ffn_dim_multiplier"))
    rope_theta = float(params.get("rope_theta", 10000.0))
    family = "llama3" if vocab >= 128000 or rope_theta >= 500000 else "llama2"
    return DecoderArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=int(params.get("n_kv_heads") or n_heads),
        vocab_size=vocab, ffn_dim=ffn_dim, norm_eps=float(params.get("norm_eps", 1e-5)), rope_theta=rope_theta,
        rope_scaling_factor=8.0 if params.get("use_scaled_rope") else None,
        max_seq_len=8192 if family == "llama3" else 4096, family=family,
    )


def read_meta(params: dict[str, Any], shards: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor],
                                                                                    DecoderArgs]:
    """Our state dict and the args of a Meta checkpoint: params.json and its consolidated.*.pth shards in order."""
    args = args_from_meta_params(params, shards[0], n_shards=len(shards))
    return from_meta(shards, args), args


def _meta_shard_dim(key: str, args: DecoderArgs | None) -> int | None:
    """The dim Meta's model-parallel shards split `key` along (models/decoder/sharding.py), None = replicated."""
    if key == "tok_embeddings.weight" and (args is None or args.family != "llama3"):
        # Llama 2's ParallelEmbedding splits the embedding by channel; Llama 3 by vocabulary, as ours is.
        return 1
    if key in ROOT_SHARD_DIM:
        return ROOT_SHARD_DIM[key]
    match = OUR_LAYER_KEY.fullmatch(key)
    if match is None or match.group(2) not in LAYER_SHARD_DIM:
        raise CheckpointError(f"Meta checkpoint key '{key}' is not a Llama parameter; is this a consolidated.pth?")
    return LAYER_SHARD_DIM[match.group(2)]

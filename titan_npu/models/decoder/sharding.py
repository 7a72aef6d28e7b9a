"""Every kind of parameter of the dense decoder: its full shape and the dim Megatron-style column / row
parallelism splits it along (None = replicated).

One table for the places that need it: the tensor-parallel plan (parallelize.py) produces these placements, Meta's
model-parallel checkpoints (consolidated.00.pth, .01, ...) are cut the same way (the Llama adapter merges them), and
the memory planner sizes each rank's shards with it. Column-parallel projections (wq, wk, wv, w1, w3, output) cut
their output features (dim 0), and their biases with them; row-parallel ones (wo, w2) their input features (dim 1);
norms are replicated (q_norm / k_norm act on one head, which a rank holds whole).
"""

from __future__ import annotations

from titan_npu.models.decoder.args import DecoderArgs

# Inside a transformer block, by the name after "layers.N.", in the model's parameter order (Llama's set).
LAYER_SHARD_DIM: dict[str, int | None] = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w2.weight": 1,
    "feed_forward.w3.weight": 0,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
}
QKV_BIAS_SHARD_DIM: dict[str, int | None] = {"attention.wq.bias": 0, "attention.wk.bias": 0, "attention.wv.bias": 0}
QK_NORM_SHARD_DIM: dict[str, int | None] = {"attention.q_norm.weight": None, "attention.k_norm.weight": None}

# Outside the blocks. The embedding is vocabulary-parallel (dim 0) here and in Llama 3's checkpoints; Llama 2's
# ParallelEmbedding cuts the channels instead (the Llama adapter handles that one exception).
ROOT_SHARD_DIM: dict[str, int | None] = {
    "tok_embeddings.weight": 0,
    "norm.weight": None,
    "output.weight": 0,
}

# Every kind any decoder has, by parameter kind: a block parameter by its name inside the block, a root one by its own.
SHARD_DIM: dict[str, int | None] = {**LAYER_SHARD_DIM, **QKV_BIAS_SHARD_DIM, **QK_NORM_SHARD_DIM, **ROOT_SHARD_DIM}


def parameter_kinds(args: DecoderArgs) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each kind of parameter the model of `args` has -> (full shape, tensor-parallel dim), in the model's order.

    A tied model has no output.weight of its own (the embedding serves).
    """
    d, q, kv, f, v, hd = args.dim, args.q_dim, args.kv_dim, args.ffn_dim, args.vocab_size, args.head_dim
    bias = args.qkv_bias
    shapes: dict[str, tuple[int, ...]] = {
        "attention.wq.weight": (q, d), **({"attention.wq.bias": (q,)} if bias else {}),
        "attention.wk.weight": (kv, d), **({"attention.wk.bias": (kv,)} if bias else {}),
        "attention.wv.weight": (kv, d), **({"attention.wv.bias": (kv,)} if bias else {}),
        "attention.wo.weight": (d, q),
        **({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)} if args.qk_norm else {}),
        "feed_forward.w1.weight": (f, d),
        "feed_forward.w2.weight": (d, f),
        "feed_forward.w3.weight": (f, d),
        "attention_norm.weight": (d,),
        "ffn_norm.weight": (d,),
    }
    shapes.update({"tok_embeddings.weight": (v, d), "norm.weight": (d,)})
    if not args.tie_embeddings:
        shapes["output.weight"] = (v, d)
    return {kind: (shape, SHARD_DIM[kind]) for kind, shape in shapes.items()}


def block_kinds(args: DecoderArgs) -> list[str]:
    """The kinds of parameter one block of `args` holds, in the model's order."""
    return [kind for kind in parameter_kinds(args) if kind not in ROOT_SHARD_DIM]

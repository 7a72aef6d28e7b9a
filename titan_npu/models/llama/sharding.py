"""Which dim each Llama parameter is split along under Megatron-style column / row parallelism (None = replicated).

One table for the places that need it: the tensor-parallel plan (parallelize.py) produces these placements, Meta's
model-parallel checkpoints (consolidated.00.pth, .01, ...) are cut the same way (state_dict_adapter.py merges
them), and the memory planner (tools/memory_model.py) sizes each rank's shards with it. Column-parallel projections
(wq, wk, wv, w1, w3, output) cut their output features (dim 0), row-parallel ones (wo, w2) their input features
(dim 1); norms are replicated.
"""

from __future__ import annotations

# Inside a transformer block, by the name after "layers.N.", in the model's parameter order.
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

# Outside the blocks. The embedding is vocabulary-parallel (dim 0) here and in Llama 3's checkpoints; Llama 2's
# ParallelEmbedding cuts the channels instead (state_dict_adapter.py handles that one exception).
ROOT_SHARD_DIM: dict[str, int | None] = {
    "tok_embeddings.weight": 0,
    "norm.weight": None,
    "output.weight": 0,
}

# Both, by parameter kind: a block parameter by its name inside the block, a root one by its own name.
SHARD_DIM: dict[str, int | None] = {**LAYER_SHARD_DIM, **ROOT_SHARD_DIM}

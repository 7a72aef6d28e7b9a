"""The model's compute ops (attention, rms_norm, rotary embedding, swiglu, linear, swiglu_linear, grouped_mm, the
MoE routing steps moe_topk_softmax, moe_permute, moe_unpermute, and DeepSeek Sparse Attention's indexer_topk,
sparse_attention and indexer_warmup_loss) behind one dispatch point per op.

Every op has a plain-torch reference (ops/reference.py); vendor backends (ops/npu.py, ops/cuda.py) register
faster kernels per op with register_backend, and set_kernels chooses between them (see docs/model.md).
"""

from titan_npu.ops.dispatch import (
    OP_NAMES,
    apply_rotary_emb,
    attention,
    available_backends,
    current_kernels,
    grouped_mm,
    indexer_topk,
    indexer_warmup_loss,
    linear,
    moe_permute,
    moe_topk_softmax,
    moe_unpermute,
    register_backend,
    rms_norm,
    set_kernels,
    sparse_attention,
    swiglu,
    swiglu_linear,
)

__all__ = [
    "OP_NAMES",
    "apply_rotary_emb",
    "attention",
    "available_backends",
    "current_kernels",
    "grouped_mm",
    "indexer_topk",
    "indexer_warmup_loss",
    "linear",
    "moe_permute",
    "moe_topk_softmax",
    "moe_unpermute",
    "register_backend",
    "rms_norm",
    "set_kernels",
    "sparse_attention",
    "swiglu",
    "swiglu_linear",
]

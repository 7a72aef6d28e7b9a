"""DeepSeek-V3.2's planner terms: DeepSeek-V3's (MLA, the MoE layers) plus the lightning indexer's bytes and FLOPs,
and attention's FLOPs over the keys each query keeps."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.args import present_fields
from titan_npu.models.deepseek_v3.cost import mla_attention_bytes
from titan_npu.models.deepseek_v3.cost import model_lines as v3_model_lines
from titan_npu.models.deepseek_v32.args import DENSE_WARMUP, DSA_OWN
from titan_npu.models.moe.cost import moe_block_costs
from titan_npu.models.spec import BlockCost, CostSite, CostTerm, TokenBytes


def indexer_bytes(args: Any, site: CostSite) -> int:
    """Per token, what a learning indexer keeps for its backward beyond MLA's tensors (0 when it is frozen): its
    query and key in fp32 (4 H_I D_I + 4 D_I), the key's LayerNorm input and statistics (c D_I + 8) and its
    per-head weights in fp32 (4 H_I). The scores against every key (4 H_I S) are not counted: a cost term is per
    token at any sequence length (docs/models.md, "DeepSeek Sparse Attention")."""
    if not args.trains_indexer:
        return 0
    h, d = args.index_n_heads, args.index_head_dim
    return 4 * h * d + 4 * d + site.compute_bytes * d + 8 + 4 * h


def dsa_attention_bytes(args: Any, site: CostSite) -> TokenBytes:
    """MLA's bytes plus the indexer's."""
    mla = mla_attention_bytes(args, site)
    extra = indexer_bytes(args, site)
    return TokenBytes(mla.saved + extra, mla.op_saves + extra, mla.transient)


DSA_MLA = CostTerm("dsa_mla", dsa_attention_bytes)


def block_costs(args: Any) -> list[BlockCost]:
    """Every block: sparse MLA (the plain path's masked attention keeps its probabilities: eager, except in the dense
    warm-up, which runs the attention kernel), a SwiGLU in the first_k_dense blocks and a MoE layer after them."""
    return moe_block_costs(args, DSA_MLA, eager=args.dsa_stage != DENSE_WARMUP)


def training_flops(args: Any, seq_len: int) -> float:
    """args.num_flops_per_token: 6 N, attention over min(index_topk, S) keys (S in the dense warm-up) and the
    indexer's scoring of all S keys."""
    return float(args.num_flops_per_token(seq_len))


def model_lines(args: Any) -> list[tuple[str, Any]]:
    """DeepSeek-V3's [model] lines and the indexer's."""
    own = [(key, value) for key, value in v3_model_lines(args) if key != "mtp_depth"]  # no [model] key here
    shared = [("indexer_types", args.indexer_types)] if args.indexer_types is not None else []  # GLM-5's sharing
    return own + present_fields(args, DSA_OWN) + shared

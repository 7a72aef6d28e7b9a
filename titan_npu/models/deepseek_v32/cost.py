"""DeepSeek-V3.2's planner terms: DeepSeek-V3's (MLA, the MoE layers) plus the lightning indexer's bytes and FLOPs,
and attention's FLOPs over the keys each query keeps."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.args import present_fields
from titan_npu.models.deepseek_v3.cost import mla_attention_bytes
from titan_npu.models.deepseek_v3.cost import model_lines as v3_model_lines
from titan_npu.models.deepseek_v32.args import DENSE_WARMUP, DSA_OWN, TARGET_HEADS_AT_ONCE
from titan_npu.models.moe.cost import moe_block_costs
from titan_npu.models.spec import BlockCost, CostSite, CostTerm, TokenBytes


def indexer_bytes(args: Any, site: CostSite) -> int:
    """Per token, what a learning indexer keeps for its backward beyond MLA's tensors (0 when it is frozen): its
    query and key in fp32 (4 H_I D_I + 4 D_I), the key's LayerNorm input and statistics (c D_I + 8) and its
    per-head weights in fp32 (4 H_I); and per key of the sequence (site.seq_len of them, indexer_key_bytes)."""
    if not args.trains_indexer:
        return 0
    h, d = args.index_n_heads, args.index_head_dim
    return 4 * h * d + 4 * d + site.compute_bytes * d + 8 + 4 * h + site.seq_len * indexer_key_bytes(args)


def indexer_key_bytes(args: Any) -> int:
    """Per (token, key) pair, what a learning indexer keeps for its backward, as measured on CPU
    (tests/tools/test_plan_dsa_memory.py): the scores of every head, fp32, ReLU'd (4 H_I) and a byte more per head,
    the key copy that the broadcast matmul q [B, S, H_I, D_I] @ k^T [B, 1, D_I, S] makes for every query (4 D_I,
    fp32), and the KL's log-softmax and target (fp32), the selection and two boolean masks (12)."""
    return 5 * args.index_n_heads + 4 * args.index_head_dim + 12


def indexer_transient_bytes(args: Any, site: CostSite) -> int:
    """Per token, the indexer's largest transient, per key of the sequence (site.seq_len of them), measured on CPU:
    a learning indexer's backward (the key copy's gradient and the scores', 4 D_I + H_I) or its KL target (three
    fp32 tensors per head of a TARGET_HEADS_AT_ONCE group of the main attention's heads, and the head sum and its
    total); a frozen indexer scores every key all the same, without gradient (the key copy, the scores and their
    scaled and ReLU'd copies: 4 D_I + 5 H_I, beside its fp32 query, 4 H_I D_I per token), in its forward."""
    h, d = args.index_n_heads, args.index_head_dim
    if not args.trains_indexer:
        return site.seq_len * (4 * d + 5 * h) + 4 * h * d
    target = 12 * min(TARGET_HEADS_AT_ONCE, args.n_heads // site.tp) + 8
    return site.seq_len * max(4 * d + h, target)


def dsa_attention_bytes(args: Any, site: CostSite) -> TokenBytes:
    """MLA's bytes plus the indexer's (its transient the block's backward's)."""
    mla = mla_attention_bytes(args, site)
    extra = indexer_bytes(args, site)
    return TokenBytes(mla.saved + extra, mla.op_saves + extra, max(mla.transient, indexer_transient_bytes(args, site)))


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

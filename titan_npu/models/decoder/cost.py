"""The dense decoder's planner terms (models/decoder/model.py with the reference ops): softmax attention's and the
SwiGLU feed-forward's per-token activation bytes (its FLOPs are the standard count, ModelSpec.training_flops None).
Families built on the decoder take
them as they are or add their own (docs/planning.md has the formulas; planner/activations.py adds the norms, the
residual stream and the attention kernel's tensors)."""

from __future__ import annotations

from typing import Any

from titan_npu.models.spec import BlockCost, CostSite, CostTerm, TokenBytes


def norm_width(site: CostSite) -> int:
    """Bytes per value an RMSNorm keeps: its input in the projections' dtype with the cpu reference without TP
    (hand-written backward), else the fp32 input and normalised value."""
    return site.compute_bytes if site.device_type == "cpu" and site.tp == 1 else 8


def qk_norm_bytes(args: Any, site: CostSite) -> int:
    """Per token, what a per-head q/k RMSNorm keeps (0 without one): what the other norms keep, per (token, head)
    row and in the projections' dtype: its input (c (q + kv)) and rstd (4 per head) with the cpu reference, else
    the fp32 input and normalised value (8 (q + kv)) and rstd; on the heads a tensor-parallel rank holds, so
    sequence parallelism does not split it further."""
    if not args.qk_norm:
        return 0
    tp = site.tp
    q, kv = args.q_dim // tp, args.kv_dim // tp
    return norm_width(site) * (q + kv) + 4 * (args.n_heads // tp + args.n_kv_heads // tp)


def attention_bytes(args: Any, site: CostSite) -> TokenBytes:
    """Per token, what softmax attention keeps beyond the kernel's q, k, v and output (the planner's): the q/k
    norms (Qwen2-style q/k/v biases keep nothing: an add's backward needs no input); op-level checkpointing keeps
    q, k, v, wo's and attention's outputs (c (q + 2 kv + D + q))."""
    c, tp = site.compute_bytes, site.tp
    q, kv = args.q_dim // tp, args.kv_dim // tp
    return TokenBytes(qk_norm_bytes(args, site), c * (q + 2 * kv + args.dim + q))


def swiglu_bytes(args: Any, site: CostSite) -> TokenBytes:
    """Per token, a SwiGLU feed-forward's: gate, silu(gate), up and their product (4 c F); op-level checkpointing
    keeps w1's and w3's outputs and w2's (c (2 F + D)); about one fp32 F-wide gradient is alive in its backward."""
    c, f = site.compute_bytes, args.ffn_dim // site.tp
    return TokenBytes(4 * c * f, c * (2 * f + args.dim), 4 * f)


ATTENTION = CostTerm("attention", attention_bytes)
SWIGLU = CostTerm("swiglu", swiglu_bytes)
DENSE_BLOCK = BlockCost(ATTENTION, SWIGLU)


def block_costs(args: Any) -> list[BlockCost]:
    """Every block of a dense decoder: softmax attention and a SwiGLU."""
    return [DENSE_BLOCK] * args.n_layers


"""DeepSeek-V3's planner terms: multi-head latent attention's activation bytes, FLOPs with its head dims and
multi-token prediction blocks, and the [model] lines `titan-npu import` prints for it."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.args import present_fields
from titan_npu.models.decoder.cost import norm_width, qk_norm_bytes
from titan_npu.models.deepseek_v3.args import YARN_FIELDS
from titan_npu.models.moe.cost import moe_block_costs
from titan_npu.models.moe_decoder.args import MOE_PRINTED
from titan_npu.models.spec import BlockCost, CostSite, CostTerm, TokenBytes

MLA_PRINTED = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_shared_experts", "n_groups", "topk_groups", "route_scale", "first_k_dense", "mtp_depth")


def mla_bytes(args: Any, site: CostSite) -> tuple[int, int]:
    """Per token, what multi-head latent attention keeps beyond the kernel's q, k, v and output (those are
    H x (qk_nope + qk_rope) wide each, v padded to the query's head width): (saved, op-level saves).

    The compressed query and key/value latents (q_lora_rank r_q, kv_lora_rank r_kv; replicated over tensor-parallel
    ranks) each go through an RMSNorm, which keeps what the block norms keep (fp32 input, normalised value, rstd;
    the cpu reference without TP its input in the projections' dtype and rstd), and the up-projection after it
    keeps its input (c r); wo keeps the copy of attention's output cut back to v_head_dim (c H v). Op-level
    checkpointing keeps the five projections' outputs instead: c (r_q + r_kv + qk_rope + H (qk_nope + v))
    besides q and wo's (counted with the dense attention's). A plain query projection (q_lora_rank 0) has no
    query latent.
    """
    a, c, tp = args, site.compute_bytes, site.tp
    latents = a.q_lora_rank + a.kv_lora_rank
    norms = norm_width(site) * latents + 4 * (2 if a.q_lora_rank else 1)
    heads = a.n_heads // tp
    saved = norms + c * latents + c * heads * a.v_head_dim
    op_saves = c * (latents + a.qk_rope_head_dim + heads * (a.qk_nope_head_dim + a.v_head_dim))
    return saved, op_saves


def mla_attention_bytes(args: Any, site: CostSite) -> TokenBytes:
    """Per token, MLA beyond the kernel's tensors: mla_bytes (and q/k norms, had it any); op-level checkpointing
    keeps q's, wo's and attention's outputs (c (q + D + q)) besides mla_bytes' projections."""
    c, q = site.compute_bytes, args.q_dim // site.tp
    saved, op_saves = mla_bytes(args, site)
    return TokenBytes(qk_norm_bytes(args, site) + saved, c * (q + args.dim + q) + op_saves)


MLA = CostTerm("mla", mla_attention_bytes)


def block_costs(args: Any) -> list[BlockCost]:
    """Every block: MLA, and a SwiGLU in the first_k_dense blocks, a MoE layer after them."""
    return moe_block_costs(args, MLA)


def training_flops(args: Any, seq_len: int) -> float:
    """6 x the active non-embedding parameters plus H heads of qk_nope + qk_rope by H of v_head_dim,
    6 L' H S (qk + v), L' counting the multi-token prediction blocks too (their parameters are in the active
    ones)."""
    active = args.num_active_params(exclude_embedding=True)
    layers = args.n_layers + args.mtp_depth
    return 6.0 * active + 6.0 * layers * args.n_heads * seq_len * (args.head_dim + args.v_head_dim)


def model_lines(args: Any) -> list[tuple[str, Any]]:
    """The [model] keys beyond the decoder's that reproduce these shapes: routing, MLA, MTP, YaRN."""
    lines = present_fields(args, MOE_PRINTED) + present_fields(args, MLA_PRINTED)
    return lines + (present_fields(args, YARN_FIELDS) if args.yarn_factor is not None else [])

"""Qwen3-Next / Qwen3.5's planner terms: the gated DeltaNet blocks' activation bytes in place of attention's, the
full-attention blocks' output gate, FLOPs with the chunked delta rule, and what import prints and generate
refuses for it."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.args import present_fields
from titan_npu.models.decoder.cost import attention_bytes
from titan_npu.models.moe.cost import feed_forward
from titan_npu.models.moe_decoder.args import MOE_PRINTED
from titan_npu.models.spec import BlockCost, CostSite, CostTerm, TokenBytes

# The delta rule's chunk (ops/delta_rule.py).
CHUNK = 64


def linear_attention_bytes(args: Any, site: CostSite) -> TokenBytes:
    """Per token, a gated DeltaNet layer's (saved bytes, bytes op-level checkpointing keeps, backward transient),
    in place of attention's, with the reference chunked delta rule (ops/delta_rule.py, chunk C = 64, fp32 inside).

    The projections' outputs (c (2 Kd + 2 Vd + 2 Hv): q, k, v, z, b, a); the convolution's input and its SiLU's
    input and output (c 3 (2 Kd + Vd)); inside the delta rule, fp32 per value head: q and k after the key heads'
    repetition, their L2 norms' inputs, v, k beta, v beta, u, w and the decay-weighted q and k (4 Hv (6 dk + 3 dv)),
    the chunk's pairwise decays, UT system and intra-chunk scores (4 Hv 3 C) and the state entering each chunk
    (4 Hv dk dv / C); the gated norm's fp32 input, z and its product (12 Vd). Op-level checkpointing keeps the
    projections' outputs and the delta rule's output; the transient is the fp32 gradients of the chunk's q, k, v.
    Sizes are a tensor-parallel rank's (its heads).
    """
    a, c, chunk, tp = args, site.compute_bytes, CHUNK, site.tp
    kd, vd, hv = a.linear_key_dim // tp, a.linear_value_dim // tp, a.linear_n_v_heads // tp
    dk, dv = a.linear_k_head_dim, a.linear_v_head_dim
    projections = c * (2 * kd + 2 * vd + 2 * hv)
    saved = (projections + 3 * c * (2 * kd + vd) + 4 * hv * (6 * dk + 3 * dv) + 4 * hv * 3 * chunk
             + 4 * hv * dk * dv // chunk + 12 * vd)
    return TokenBytes(saved, projections + c * (vd + a.dim), 4 * hv * (2 * dk + dv))


def gated_attention_bytes(args: Any, site: CostSite) -> TokenBytes:
    """Per token, gated full attention: the decoder's attention terms plus its output gate and the gated output
    (2 c q)."""
    plain = attention_bytes(args, site)
    return TokenBytes(plain.saved + 2 * site.compute_bytes * (args.q_dim // site.tp), plain.op_saves)


LINEAR_ATTENTION = CostTerm("linear_attention", linear_attention_bytes)
GATED_ATTENTION = CostTerm("gated_attention", gated_attention_bytes)


def block_costs(args: Any) -> list[BlockCost]:
    """Every block: gated DeltaNet (its own tensors, no softmax kernel) or gated full attention, and its layer's
    feed-forward."""
    return [BlockCost(LINEAR_ATTENTION, feed_forward(args, i), softmax=False) if args.is_linear_layer(i)
            else BlockCost(GATED_ATTENTION, feed_forward(args, i)) for i in range(args.n_layers)]


def training_flops(args: Any, seq_len: int) -> float:
    """Qwen3NextArgs.num_flops_per_token: 12 H head_dim S per full layer, the chunked delta rule's matmuls per
    linear layer."""
    return float(args.num_flops_per_token(seq_len))


def model_lines(args: Any) -> list[tuple[str, Any]]:
    """The [model] keys beyond the decoder's that reproduce these shapes: routing, layer types, the linear layers
    and the gated shared expert."""
    return present_fields(args, MOE_PRINTED) + present_fields(args, (
        "layer_types", "shared_ffn_dim", "full_attention_interval", "partial_rotary_factor", "linear_n_k_heads",
        "linear_n_v_heads", "linear_k_head_dim", "linear_v_head_dim", "linear_conv_kernel", "variant"))


def generate_refusal(args: Any) -> str:
    """Why tools/generate.py cannot decode this model."""
    return (f"generate has no cached decoding for {args.family} (its linear-attention layers need a recurrent-state "
            f"cache, its gated attention an output gate); evaluate it with the training loss, or export it "
            f"(--format hf) and generate with transformers")

"""The MoE feed-forward's planner terms (models/moe/layer.py), counted under balanced routing: every token's top_k
copies, whichever rank's experts run them."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.cost import ATTENTION, SWIGLU
from titan_npu.models.spec import BlockCost, CostSite, CostTerm, ExpertTerms, TokenBytes

# Bytes of the int64 index tensors a MoE layer keeps per routed copy: the sort order, its inverse and the source
# token of each copy (layer.py), and under expert parallelism the exchange's regrouping order (dispatch.py).
MOE_INDEX_BYTES = 24
EP_INDEX_BYTES = 16


def moe_ffn_bytes(args: Any, site: CostSite) -> TokenBytes:
    """Per token, a MoE feed-forward's (saved bytes, bytes op-level checkpointing keeps, backward transient).

    The router keeps its fp32 probabilities (4 E) and top-k indices and weights (16 k); the group-limited sigmoid
    router (group_router.py) keeps the same plus the fp32 copy of its input it scores in (4 D, when the input is
    not fp32 already): its group choice only picks indices, whose graph is freed at once. Each of the k routed
    copies keeps its sort indices, the grouped GEMM's input row (c D), gate, silu(gate), up and their product
    (4 c F_moe, as the dense SwiGLU) and its output row for the weighting (c D); a shared expert keeps a dense
    SwiGLU's 4 c F_shared. Balanced routing: every rank runs k copies per token, under expert parallelism too (the
    exchange sends and receives as many rows; the received ones are what the grouped GEMM keeps).
    """
    m, c = args.moe_args(), site.compute_bytes
    k, d, f, e, shared = m.top_k, m.dim, m.ffn_dim, m.n_experts, m.shared_ffn_dim
    index = MOE_INDEX_BYTES + (EP_INDEX_BYTES if site.expert_parallel else 0)
    router = 4 * e + 16 * k + (4 * d if m.router == "sigmoid_group" and c < 4 else 0)
    saved = router + k * (index + 2 * c * d + 4 * c * f) + 4 * c * shared
    # Op-level checkpointing keeps the matmul outputs (activation_checkpoint.py's list): the router's logits and the
    # shared expert's projections; the grouped GEMM is not on the list, so the experts are recomputed.
    op_saves = c * e + c * (2 * shared + d if shared else 0)
    transient = k * 4 * f + 4 * shared
    return TokenBytes(saved, op_saves, transient)


MOE_FFN = CostTerm("moe", moe_ffn_bytes)


def feed_forward(args: Any, layer_id: int) -> CostTerm:
    """Block `layer_id`'s feed-forward: a MoE layer's, or the dense SwiGLU of a layer that is none."""
    return MOE_FFN if args.is_moe_layer(layer_id) else SWIGLU


def moe_block_costs(args: Any, mixer: CostTerm = ATTENTION, eager: bool = False) -> list[BlockCost]:
    """Every block of a MoE decoder: softmax attention by `mixer` (the decoder's by default; `eager`: one that always
    runs the plain path) and its layer's feed-forward."""
    blocks = {ffn: BlockCost(mixer, ffn, eager=eager) for ffn in (SWIGLU, MOE_FFN)}
    return [blocks[feed_forward(args, i)] for i in range(args.n_layers)]


def routed_active_params(args: Any) -> int:
    """The routed experts' matmul weights one token meets over every MoE layer: its top_k experts' 3 D F each."""
    m = args.moe_args()
    return args.n_moe_layers * m.top_k * 3 * m.dim * m.ffn_dim


def describe(args: Any) -> str:
    """The plan's line on the MoE layers: '48 MoE layers of 128 experts (top 8, ffn 768)'."""
    m = args.moe_args()
    return f"{args.n_moe_layers} MoE layers of {m.n_experts} experts (top {m.top_k}, ffn {m.ffn_dim})"


# The shared MoE block's expert terms (its args' is_moe_layer, n_moe_layers and moe_args()): every MoE family's.
MOE_EXPERTS = ExpertTerms(
    moe_block=lambda args, layer_id: args.is_moe_layer(layer_id),
    n_moe_blocks=lambda args: args.n_moe_layers,
    n_routed=lambda args: args.moe_args().n_experts,
    routed_copies=lambda args: args.moe_args().top_k,
    all_to_all_width=lambda args: args.moe_args().dim,
    routed_active_params=routed_active_params,
    describe=describe,
)

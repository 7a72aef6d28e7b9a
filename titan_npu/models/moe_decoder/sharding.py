"""Every kind of parameter of a MoE decoder: the dense decoder's, with the MoE layers' router and stacked
experts. Under tensor parallelism each expert is split on its ffn dim (w1 / w3 dim 1, w2 dim 2) and the router is
replicated (tensor-parallel dim None), a shared expert split as the dense SwiGLU (models/moe/parallelize.py)."""

from __future__ import annotations

from titan_npu.models.decoder.sharding import parameter_kinds as decoder_kinds
from titan_npu.models.moe_decoder.args import MoEDecoderArgs

DENSE_FFN = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def parameter_kinds(args: MoEDecoderArgs) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each kind of parameter -> (full shape, tensor-parallel dim): the dense SwiGLU's kinds only if some layer is
    dense, the MoE kinds if some layer is MoE (a kind names a parameter inside any block that has it)."""
    d, e, f = args.dim, args.n_experts, args.moe_ffn_dim
    kinds = decoder_kinds(args)
    if all(args.is_moe_layer(i) for i in range(args.n_layers)):
        kinds = {k: v for k, v in kinds.items() if k not in DENSE_FFN}
    if args.n_moe_layers:
        kinds.update({"feed_forward.router.gate.weight": ((e, d), None), "feed_forward.experts.w1": ((e, f, d), 1),
                      "feed_forward.experts.w2": ((e, d, f), 2), "feed_forward.experts.w3": ((e, f, d), 1)})
        if args.shared_ffn_dim:
            s = args.shared_ffn_dim
            kinds.update({"feed_forward.shared_experts.w1.weight": ((s, d), 0),
                          "feed_forward.shared_experts.w2.weight": ((d, s), 1),
                          "feed_forward.shared_experts.w3.weight": ((s, d), 0)})
    return kinds

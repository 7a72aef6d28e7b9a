"""Every kind of parameter of a Qwen3-Next / Qwen3.5 model: the MoE decoder's (or the dense decoder's when nothing is
routed) with the gated attention's doubled q projection and zero-centred norms, the linear layers' own kinds, and the
shared expert's gate. Under tensor parallelism (parallelize.py) a linear layer's projections, convolution channels and
per-head decay parameters are split by head (dim 0), its output projection row-wise (dim 1), its gated norm's weight
and the shared expert's gate replicated."""

from __future__ import annotations

from titan_npu.models.decoder.sharding import parameter_kinds as decoder_kinds
from titan_npu.models.moe_decoder.sharding import parameter_kinds as moe_kinds
from titan_npu.models.qwen3_next.args import Qwen3NextArgs

# The kinds only a linear (gated DeltaNet) block holds, in the model's order (own parameters, then projections).
LINEAR_KINDS = ("attention.conv_q", "attention.conv_k", "attention.conv_v", "attention.A_log", "attention.dt_bias",
                "attention.norm_weight", "attention.in_q.weight", "attention.in_k.weight", "attention.in_v.weight",
                "attention.in_z.weight", "attention.in_b.weight", "attention.in_a.weight", "attention.out.weight")


def parameter_kinds(args: Qwen3NextArgs) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each kind of parameter -> (full shape, tensor-parallel dim), in the model's order."""
    d, kd, vd, h, w = args.dim, args.linear_key_dim, args.linear_value_dim, args.linear_n_v_heads, \
        args.linear_conv_kernel
    kinds = moe_kinds(args) if args.n_experts else decoder_kinds(args)
    linear = {"attention.conv_q": ((kd, w), 0), "attention.conv_k": ((kd, w), 0),
              "attention.conv_v": ((vd, w), 0), "attention.A_log": ((h,), 0), "attention.dt_bias": ((h,), 0),
              "attention.norm_weight": ((args.linear_v_head_dim,), None), "attention.in_q.weight": ((kd, d), 0),
              "attention.in_k.weight": ((kd, d), 0), "attention.in_v.weight": ((vd, d), 0),
              "attention.in_z.weight": ((vd, d), 0), "attention.in_b.weight": ((h, d), 0),
              "attention.in_a.weight": ((h, d), 0), "attention.out.weight": ((d, vd), 1)}
    out: dict[str, tuple[tuple[int, ...], int | None]] = {}
    for kind, value in kinds.items():
        if kind == "attention.wq.weight":
            if args.n_linear_layers:
                out.update(linear)
            if args.n_linear_layers == args.n_layers:
                continue
            value = ((2 * args.q_dim, d), 0)
        elif kind.startswith("attention.") and args.n_linear_layers == args.n_layers:
            continue
        out[kind] = value
        if kind == "feed_forward.shared_experts.w3.weight" and args.shared_ffn_dim:
            out["feed_forward.shared_gate.weight"] = ((1, d), None)
    return out


def holds_kind(args: Qwen3NextArgs, layer_id: int, kind: str) -> bool:
    """Whether block `layer_id` holds a parameter of `kind` as far as its token mixer goes (linear or full)."""
    if not kind.startswith("attention."):
        return True
    return (kind in LINEAR_KINDS) == args.is_linear_layer(layer_id)

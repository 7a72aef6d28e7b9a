"""Every kind of parameter of a gpt-oss model: the MoE decoder's (every layer MoE), with the o-projection's bias, the
attention sinks, the router's bias and the experts' biases. Under tensor parallelism (parallelize.py) the sinks are
split by head, b1 / b3 on the ffn dim; the o-projection's, the router's and b2 are replicated."""

from __future__ import annotations

from titan_npu.models.gpt_oss.args import GptOssArgs
from titan_npu.models.moe_decoder.sharding import parameter_kinds as moe_kinds


def parameter_kinds(args: GptOssArgs) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each kind of parameter -> (full shape, tensor-parallel dim)."""
    d, e, f = args.dim, args.n_experts, args.moe_ffn_dim
    return {**moe_kinds(args), "attention.wo.bias": ((d,), None), "attention.sinks": ((args.n_heads,), 0),
            "feed_forward.router.gate.bias": ((e,), None), "feed_forward.experts.b1": ((e, f), 1),
            "feed_forward.experts.b2": ((e, d), None), "feed_forward.experts.b3": ((e, f), 1)}

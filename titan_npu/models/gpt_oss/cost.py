"""gpt-oss's planner terms: attention with sinks runs the plain torch path (ops/reference.py: sink_attention),
which keeps the B H S^2 probabilities as eager attention does; its FLOPs count the keys each layer's query sees."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.args import present_fields
from titan_npu.models.decoder.cost import ATTENTION
from titan_npu.models.moe.cost import moe_block_costs
from titan_npu.models.moe_decoder.args import MOE_PRINTED
from titan_npu.models.spec import BlockCost

YARN_PRINTED = ("yarn_factor", "yarn_original_seq_len", "yarn_beta_fast", "yarn_beta_slow", "yarn_truncate")


def block_costs(args: Any) -> list[BlockCost]:
    """Every block: sink attention (no fused kernel takes a sink) and its layer's feed-forward."""
    return moe_block_costs(args, ATTENTION, eager=True)


def training_flops(args: Any, seq_len: int) -> float:
    """GptOssArgs.num_flops_per_token: 12 H head_dim times the keys each layer's query sees."""
    return float(args.num_flops_per_token(seq_len))


def model_lines(args: Any) -> list[tuple[str, Any]]:
    """The [model] keys beyond the decoder's that reproduce these shapes: routing, YaRN, windows, the experts' clamp."""
    lines = present_fields(args, MOE_PRINTED)
    lines += present_fields(args, YARN_PRINTED) if args.yarn_factor is not None else []
    return lines + present_fields(args, ("sliding_window", "layer_types", "swiglu_limit"))

"""GLM-4.5's planner terms and printed [model] keys.

Its blocks are the MoE decoder's (models/moe/cost.py): softmax attention (the decoder's term, q/k norms counted when
the flavor has them) and a SwiGLU in the first_k_dense blocks, a MoE layer after them; the partial rotation keeps
nothing per token beyond what the kernel's q and k are (its products are freed once concatenated). Its FLOPs are the
standard count (6 N + 12 L H D S)."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder.args import present_fields
from titan_npu.models.glm4_moe.args import GLM4_MOE_OVERRIDABLE
from titan_npu.models.moe.cost import moe_block_costs
from titan_npu.models.spec import BlockCost


def block_costs(args: Any) -> list[BlockCost]:
    """Every block: softmax attention, and a SwiGLU in the first_k_dense blocks, a MoE layer after them."""
    return moe_block_costs(args)


def model_lines(args: Any) -> list[tuple[str, Any]]:
    """The [model] keys beyond the decoder's that reproduce these shapes: partial RoPE and the routing."""
    return present_fields(args, GLM4_MOE_OVERRIDABLE)

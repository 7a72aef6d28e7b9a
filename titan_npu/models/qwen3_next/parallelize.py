"""How a Qwen3-Next / Qwen3.5 model is parallelised: the MoE decoder's steps (models/moe_decoder/parallelize.py:
expert parallelism, activation checkpointing, compile per block, FSDP / HSDP and pipeline stages as the decoder's).

Refused in one line (check_qwen3_next_layout): tensor parallelism (the linear layers' projections, convolution,
per-head decay parameters and gated norm have no tensor-parallel plan yet) and context parallelism (the gated delta
rule's state would have to pass from one cp rank's chunk of the sequence to the next: no cross-rank scan yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titan_npu.errors import LayoutError
from titan_npu.models.moe_decoder.parallelize import parallelize_moe
from titan_npu.models.qwen3_next.args import Qwen3NextArgs
from titan_npu.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def check_qwen3_next_layout(dims: ParallelDims, args: Qwen3NextArgs, cfg: JobConfig) -> None:
    """The layouts above refused (LayoutError): parallelize_qwen3_next's first step, and what the planner's search
    skips (ModelSpec.check_layout)."""
    if dims.cp_enabled:
        raise LayoutError(f"parallel.cp_degree={dims.cp}: Qwen3-Next's linear-attention layers have no context-"
                          f"parallel scan (their recurrent state does not pass between cp ranks); set "
                          f"parallel.cp_degree = 1")
    if dims.tp_enabled:
        raise LayoutError(f"parallel.tp_degree={dims.tp}: Qwen3-Next's linear-attention layers have no tensor-"
                          f"parallel plan yet; set parallel.tp_degree = 1 (FSDP, expert and pipeline parallelism "
                          f"apply)")


def parallelize_qwen3_next(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """The MoE decoder's parallelisation, after refusing the layouts above."""
    check_qwen3_next_layout(dims, model.args, cfg)
    return parallelize_moe(model, dims, cfg)

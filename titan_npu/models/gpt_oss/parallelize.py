"""How a gpt-oss model is parallelised: expert parallelism (parallel.ep_degree: the experts, their biases with them,
split over the ep ranks, models/moe/parallelize.py), then activation checkpointing, compile per block and data
parallelism (FSDP / HSDP / replicate) as for the dense decoder; pipeline stages split as the decoder's.

Refused in one line: tensor parallelism (the sinks are per head and the experts' down-projection bias would be
added once per tp rank; not split yet) and context parallelism (the ring / Ulysses attention takes no sink or
window)."""

from __future__ import annotations

from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.errors import LayoutError
from titan_npu.models.decoder.parallelize import parallelize_decoder
from titan_npu.models.gpt_oss.args import GptOssArgs
from titan_npu.models.moe.parallelize import apply_expert_parallel
from titan_npu.parallel.dims import ParallelDims


def check_gpt_oss_layout(dims: ParallelDims, args: GptOssArgs, cfg: JobConfig) -> None:
    """The layouts above refused (LayoutError): parallelize_gpt_oss's first step, and what the planner's search
    skips (ModelSpec.check_layout)."""
    if dims.tp_enabled:
        raise LayoutError(f"parallel.tp_degree={dims.tp}: gpt-oss's attention sinks and expert biases are not split "
                          f"by tensor parallelism yet; set parallel.tp_degree = 1 (FSDP, expert or pipeline "
                          f"parallelism instead)")
    if dims.cp_enabled:
        raise LayoutError(f"parallel.cp_degree={dims.cp}: context-parallel attention takes no attention sink or "
                          f"sliding window (gpt-oss); set parallel.cp_degree = 1")


def parallelize_gpt_oss(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Expert parallelism, then the dense decoder's activation checkpointing, compile and data parallelism; the
    layouts above refused (check_gpt_oss_layout)."""
    check_gpt_oss_layout(dims, model.args, cfg)
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.ep_mesh)
    return parallelize_decoder(model, dims, cfg)

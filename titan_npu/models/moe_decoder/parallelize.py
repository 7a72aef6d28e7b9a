"""How a MoE decoder is parallelised: as the dense decoder (parallelize_decoder: activation checkpointing,
compile per block, FSDP / HSDP / replicate with the stacked experts sharded on their expert dim like any
parameter's dim 0), pipeline stages split as the decoder's; under expert parallelism (parallel.ep_degree) the
experts are split over the ep ranks first (models/moe/parallelize.py) and FSDP leaves them. Under tensor parallelism
attention, norms, embedding, output and dense layers take the decoder's plan and each MoE layer splits its experts
on their ffn dim with the router replicated (models/moe/parallelize.py, layer.py). The layouts this version does not
take are refused by parallel/layout.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titan_npu.models.decoder.parallelize import parallelize_decoder
from titan_npu.models.moe.parallelize import apply_expert_parallel, apply_expert_tensor_parallel
from titan_npu.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def parallelize_moe(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Expert and MoE tensor parallelism, then the decoder's TP plan, activation checkpointing, compile and data
    parallelism."""
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.ep_mesh, dims.ep_tp_mesh if dims.tp_enabled else None)
    if dims.tp_enabled:
        apply_expert_tensor_parallel(model, dims.tp_mesh)
        model.sequence_shards = dims.tp
    return parallelize_decoder(model, dims, cfg)

"""How a Qwen3-MoE model is parallelised: as the dense decoder (parallelize_decoder: activation checkpointing,
compile per block, FSDP / HSDP / replicate with the stacked experts sharded on their expert dim like any
parameter's dim 0), pipeline stages split as the decoder's; under expert parallelism (parallel.ep_degree) the
experts are split over the ep ranks first (models/moe/parallelize.py) and FSDP leaves them. Tensor parallelism is
not in this version: a run asking for it is refused with a one-line error (and so are the layouts
parallel/layout.py refuses with expert parallelism)."""

from __future__ import annotations

from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.errors import LayoutError
from titan_npu.models.decoder.parallelize import parallelize_decoder
from titan_npu.models.moe.parallelize import apply_expert_parallel
from titan_npu.parallel.dims import ParallelDims


def parallelize_moe(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Expert parallelism, then activation checkpointing, compile and data parallelism as for the dense decoder; TP
    refused."""
    if dims.tp_enabled:
        raise LayoutError(f"parallel.tp_degree={dims.tp}: tensor parallelism of a MoE model ({cfg.model.name}) is not "
                          f"supported yet; set parallel.tp_degree = 1 and shard it with FSDP (parallel.dp_shard)")
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.ep_mesh)
    return parallelize_decoder(model, dims, cfg)

"""Apply parallelism to a model built on the meta device, from outside the model: FSDP2 per block, then the root."""

from __future__ import annotations

import torch
from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.errors import LayoutError
from titan_npu.parallel.dims import ParallelDims
from titan_npu.trainer.precision import to_torch_dtype


def apply_fsdp(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """fully_shard each transformer block and the root; params in the training dtype, gradients reduced in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = dims.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else dims.mesh["dp_shard"]
    dtype = to_torch_dtype(cfg.training.dtype)
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        "reshard_after_forward": cfg.parallel.reshard_after_forward,
    }
    if cfg.parallel.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def parallelize_model(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Return the model with this job's parallelism applied (unchanged on a single process)."""
    if dims.tp_enabled or dims.pp_enabled:
        raise LayoutError("tensor and pipeline parallelism are not available in this build (set tp/pp degree to 1)")
    if dims.fsdp_enabled or dims.dp_replicate > 1:
        apply_fsdp(model, dims, cfg)
    return model

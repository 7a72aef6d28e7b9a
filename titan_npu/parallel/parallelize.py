"""Apply parallelism to a model built on the meta device, from outside the model, then materialise it.

Order (each step sees the model the previous one left): pipeline split -> tensor parallel -> activation
checkpointing -> torch.compile per block -> FSDP / HSDP / replicate -> to_empty + init_weights (+ the gradient
layout hooks of pure tensor parallelism, see tp_grads.py).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.tp_grads import install_requested_grad_hooks


def parallelize_model(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Return the model (or pipeline stage) with this job's TP, AC, compile and data parallelism applied."""
    from titan_npu.models.llama.parallelize import parallelize_llama

    return parallelize_llama(model, dims, cfg)


def build_model_parts(
    cfg: JobConfig, dims: ParallelDims, model_args, device: torch.device, param_dtype: torch.dtype | None = None
) -> tuple[list[int], list[nn.Module]]:
    """(stage ids, parts) of this rank: the model built on meta, split into its pipeline stages (or whole),
    parallelised and materialised with its initial weights; param_dtype holds the parameters in that dtype."""
    from titan_npu.models.llama import Transformer
    from titan_npu.parallel.pipeline import split_for_pipeline

    with torch.device("meta"):
        model = Transformer(model_args)
    if param_dtype is not None:  # free on meta
        model.to(param_dtype)
    stage_ids, parts = split_for_pipeline(model, dims, cfg) if dims.pp_enabled else ([0], [model])
    parts = [parallelize_model(part, dims, cfg) for part in parts]
    for part in parts:
        materialize(part, device, cfg)
    return stage_ids, parts


def materialize(model: nn.Module, device: torch.device, cfg: JobConfig) -> None:
    """Allocate a meta-device model (or stage) and initialise its weights and RoPE tables.

    The weights are a function of training.seed and the model config alone: every layout (and every stage and
    shard of it) gets the same values, each rank drawing only its own shard (models/init.py).
    With CPU offload the sharded parameters live in host memory; only the buffers go to the device.
    """
    param_device = torch.device("cpu") if cfg.parallel.cpu_offload else device
    model.to_empty(device=param_device)
    with torch.no_grad():
        model.init_weights(buffer_device=device, seed=cfg.training.seed)
    # Gradient hooks must go on the real parameters (to_empty replaced the meta ones they would have been on).
    install_requested_grad_hooks(model)

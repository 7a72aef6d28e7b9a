"""Apply parallelism to a model built on the meta device, from outside the model, then materialise it.

Order (each step sees the model the previous one left): pipeline split -> float8 conversion -> tensor parallel ->
activation checkpointing -> torch.compile per block -> FSDP / HSDP / replicate -> to_empty + init_weights (+ the
gradient layout hooks of pure tensor parallelism, see tp_grads.py). What each step does to a given family's model is the
family's (its ModelSpec, models/spec.py: build_model, split_layers / build_stage, parallelize); the caller passes
the spec in, so this package never imports a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.float8 import convert_to_float8
from titan_npu.parallel.pipeline import split_for_pipeline
from titan_npu.parallel.tp_grads import install_requested_grad_hooks

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def build_model_parts(
    spec: Any, cfg: JobConfig, dims: ParallelDims, model_args: Any, device: torch.device,
    param_dtype: torch.dtype | None = None,
) -> tuple[list[int], list[nn.Module]]:
    """(stage ids, parts) of this rank: the model of `spec` (a ModelSpec) built on meta, split into its pipeline
    stages (or whole), parallelised and materialised with its initial weights; param_dtype holds the parameters in
    that dtype."""
    with torch.device("meta"):
        model = spec.build_model(model_args)
    if param_dtype is not None:  # free on meta
        model.to(param_dtype)
    stage_ids, parts = split_for_pipeline(spec, model, dims, cfg) if dims.pp_enabled else ([0], [model])
    parts = [parallelize_part(spec, part, dims, cfg) for part in parts]
    for part in parts:
        materialize(part, device, cfg)
    return stage_ids, parts


def parallelize_part(spec: Any, part: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """One model part (on meta) converted to float8 where float8.enable says (parallel/float8.py), then
    parallelised by its family (ModelSpec.parallelize)."""
    convert_to_float8(part, cfg.float8, dims.dp_mode)
    return spec.parallelize(part, dims, cfg)


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

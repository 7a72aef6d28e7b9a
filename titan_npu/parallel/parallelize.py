"""Apply parallelism to a model built on the meta device, from outside the model, then materialise it.

Order (each step sees the model the previous one left): pipeline split -> float8 conversion -> tensor parallel ->
activation checkpointing -> torch.compile per block -> FSDP / HSDP / replicate -> to_empty + init_weights (+ the
gradient layout hooks of pure tensor parallelism, see tp_grads.py). What each step does to a given family's model is the
family's (its ModelSpec, models/spec.py: build_model, split_layers / build_stage, parallelize); the caller passes
the spec in, so this package never imports a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_npu.errors import DeviceError
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.float8 import convert_to_float8
from titan_npu.parallel.pipeline import split_for_pipeline
from titan_npu.parallel.tp_grads import install_requested_grad_hooks

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def build_model_parts(
    spec: Any, cfg: JobConfig, dims: ParallelDims, model_args: Any, device: torch.device,
    param_dtype: torch.dtype | None = None, adapt: Callable[[nn.Module], Any] | None = None,
) -> tuple[list[int], list[nn.Module]]:
    """(stage ids, parts) of this rank: the model of `spec` (a ModelSpec) built on meta, changed by `adapt` (the
    trainer's: LoRA's adapters), split into its pipeline stages (or whole), parallelised and materialised with its
    initial weights; param_dtype holds the parameters in that dtype."""
    with torch.device("meta"):
        model = spec.build_model(model_args)
    if adapt is not None:  # e.g. LoRA's frozen weights and trainable adapters: before the split and any parallelism
        adapt(model)
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
    check_fits(model, param_device)
    try:
        model.to_empty(device=param_device)
        with torch.no_grad():
            model.init_weights(buffer_device=device, seed=cfg.training.seed)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and not _is_allocation_failure(e):
            raise
        raise DeviceError(_too_large(model, param_device, f"allocating it failed ({_first_line(e)})")) from None
    # Gradient hooks must go on the real parameters (to_empty replaced the meta ones they would have been on).
    install_requested_grad_hooks(model)


GB = 1024**3
_ALLOCATION_FAILURE = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def local_bytes(model: nn.Module) -> int:
    """Bytes this rank's parameters and buffers take once materialised (its shards only, for DTensors)."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def check_fits(model: nn.Module, device: torch.device) -> None:
    """DeviceError before any allocation when this rank's weights alone exceed the memory it has free (the
    gradients, optimizer state and activations need more still: no run refused here could have fitted)."""
    from titan_npu.device.memory import available_bytes

    free = available_bytes(device.type, device.index)
    if free is not None and local_bytes(model) > free:
        raise DeviceError(_too_large(model, device, f"{free / GB:.1f} GB is free"))


def _too_large(model: nn.Module, device: torch.device, why: str) -> str:
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    offload = "" if device.type == "cpu" else " or offload it to the host (parallel.cpu_offload)"
    return (f"the model is too large for this rank's {device.type} memory: {size} parameters, "
            f"{local_bytes(model) / GB:.1f} GB of weights on this rank alone, and {why}; choose a smaller model "
            f"(model.flavor, model.dim, model.n_layers), shard it over more ranks (parallel.dp_shard, tp, pp)"
            f"{offload}, and check the whole run's memory with `titan-npu plan`")


def _is_allocation_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return any(s in text for s in _ALLOCATION_FAILURE)


def _first_line(error: BaseException) -> str:
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__

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


def materialize(model: nn.Module, device: torch.device, cfg: JobConfig) -> None:
    """Allocate a meta-device model (or stage) and initialise its weights and RoPE tables.

    With CPU offload the sharded parameters live in host memory; only the buffers go to the device.
    """
    param_device = torch.device("cpu") if cfg.parallel.cpu_offload else device
    model.to_empty(device=param_device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    # Gradient hooks must go on the real parameters (to_empty replaced the meta ones they would have been on).
    install_requested_grad_hooks(model)

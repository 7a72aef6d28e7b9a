"""Tensor-parallel placements of low-rank adapters (titan_npu/lora/), set after a family's tensor-parallel plan.

An adapted linear y = W x + s B A x is cut as its base: a column-parallel W (Shard(0), each rank some outputs)
takes B by its rows (Shard(0)) and A whole; a row-parallel W (Shard(1), each rank some inputs) takes A by its
columns (Shard(1)) and B whole, so each rank's B A x is a partial sum that the base's own reduction adds up; a
replicated W keeps both whole. The plan's styles only know a linear's weight and bias, so the adapters are placed
here, on the meta device, before data parallelism shards them further.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def adapter_placements(weight_placement) -> tuple[Replicate | Shard, Replicate | Shard]:
    """(A's, B's) placement for a base weight placed `weight_placement` on the tensor-parallel mesh."""
    if weight_placement == Shard(0):
        return Replicate(), Shard(0)
    if weight_placement == Shard(1):
        return Shard(1), Replicate()
    return Replicate(), Replicate()


def place_adapters(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Give every adapter of `model` (on meta, tensor-parallelised) the placements of adapter_placements, and
    freeze again what the plan's styles made trainable (torch's SequenceParallel re-creates the norm weights as
    parameters that require gradients): a model with adapters trains them alone."""
    adapted = False
    for module in model.modules():
        if not hasattr(module, "lora_A") or not isinstance(module.weight, DTensor):
            continue
        placements = adapter_placements(module.weight.placements[-1])
        for name, placement in zip(("lora_A", "lora_B"), placements):
            param = getattr(module, name)
            whole = torch.empty(param.shape, dtype=param.dtype, device="meta")
            module.register_parameter(name, nn.Parameter(distribute_tensor(whole, tp_mesh, [placement]),
                                                         requires_grad=param.requires_grad))
        adapted = True
    if adapted:
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B"):
                param.requires_grad_(False)

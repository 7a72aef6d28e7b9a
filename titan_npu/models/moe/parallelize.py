"""Expert and tensor parallelism applied to a model from outside.

Expert parallelism: each MoE layer's stacked experts become DTensors sharded on the expert dim over the ep mesh
(global names and shapes for checkpoints and the planner, n_experts / ep experts stored per rank), and the layer
exchanges its tokens over that mesh's group (dispatch.py).

Tensor parallelism: each expert is split on its ffn dim over the tp mesh (w1 / w3 Shard(1), w2 Shard(2): column
and row parallel), the router's gate is replicated (a DTensor Replicate whose input and output are plain tensors),
a shared expert is split as the dense SwiGLU is, and the layer gathers and scatters the sequence itself
(layer.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_npu.models.moe.layer import MoE
from titan_npu.parallel.float8 import float8_plan

# The dim of each stacked expert weight that tensor parallelism splits: the ffn dim (and the biases of the gate and
# up projections with it; the down projection's bias b2 is replicated, each rank adding its share: experts.py).
EXPERT_TP_DIMS = {"w1": 1, "w3": 1, "w2": 2, "b1": 1, "b3": 1, "b2": None}


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Split the experts of every MoE layer of `model` (built on meta, before data parallelism) over ep_mesh; with
    ep_tp_mesh (ep x tp, tensor parallelism too) each rank's experts are split on their ffn dim over its tp dim as
    well (Shard(0), Shard(ffn dim))."""
    from torch.distributed.tensor import DTensor, Shard

    ep = ep_mesh.size()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            local = param.detach().chunk(ep, dim=0)[ep_mesh.get_local_rank()]
            mesh, placements = ep_mesh, [Shard(0)]
            if ep_tp_mesh is not None:
                dim, tp_mesh = EXPERT_TP_DIMS[name], ep_tp_mesh["tp"]
                local = local.chunk(tp_mesh.size(), dim=dim)[tp_mesh.get_local_rank()].contiguous()
                mesh, placements = ep_tp_mesh, [Shard(0), Shard(dim)]
            sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape,
                                         stride=param.stride())
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1.0 / ep
        module.ep_group = ep_mesh.get_group()


def apply_expert_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the experts of every MoE layer of `model` (built on meta, before data parallelism) on their ffn dim over
    tp_mesh (unless expert parallelism split them already, over both) and replicate the routers' gates over it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def replicate_gate(name: str, gate: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(gate.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            gate.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def replicated_input(gate: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

    def local_output(gate: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()

    tp = tp_mesh.size()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # split over ep x tp by apply_expert_parallel
                continue
            dim = EXPERT_TP_DIMS[name]
            if dim is None:  # the down projection's bias: whole on every rank, which adds 1 / tp of it
                sharded = DTensor.from_local(param.detach(), tp_mesh, [Replicate()], run_check=False)
                experts.bias_share = 1.0 / tp
            else:
                local = param.detach().chunk(tp, dim=dim)[tp_mesh.get_local_rank()].contiguous()
                sharded = DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False, shape=param.shape,
                                             stride=param.stride())
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        distribute_module(module.router.gate, tp_mesh, replicate_gate, replicated_input, local_output)
        if module.shared_gate is not None:  # replicated as the router is; its gradient is completed in layer.py
            distribute_module(module.shared_gate, tp_mesh, replicate_gate, replicated_input, local_output)
        if module.shared_experts is not None:
            # Column / row parallel; the partial output stays a DTensor for the layer to add before its
            # reduce-scatter (layer.py).
            parallelize_module(module.shared_experts, tp_mesh, float8_plan(module.shared_experts, {
                "w1": ColwiseParallel(), "w3": ColwiseParallel(),
                "w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False)}))
        module.tp_mesh = tp_mesh

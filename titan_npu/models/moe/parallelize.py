"""Expert parallelism applied to a model from outside: each MoE layer's stacked experts become DTensors sharded on
the expert dim over the ep mesh (global names and shapes for checkpoints and the planner, n_experts / ep experts
stored per rank), and the layer exchanges its tokens over that mesh's group (dispatch.py)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_npu.models.moe.layer import MoE


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split the experts of every MoE layer of `model` (built on meta, before data parallelism) over ep_mesh."""
    from torch.distributed.tensor import DTensor, Shard

    ep = ep_mesh.size()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            local = param.detach().chunk(ep, dim=0)[ep_mesh.get_local_rank()]
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                         stride=param.stride())
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1.0 / ep
        module.ep_group = ep_mesh.get_group()

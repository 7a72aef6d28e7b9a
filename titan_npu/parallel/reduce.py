"""Step-level reductions that must know the layout: the step's valid-label count, the logged loss, the gradient norm
and its clipping.

Under pipeline parallelism each rank holds only its stages' parameters and only the last stage sees the loss;
under tensor parallelism every tp rank holds the same loss; FSDP / TP gradients are DTensors whose norms are
partial until reduced over their mesh. These helpers combine all of that into one number per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_npu.parallel.dims import ParallelDims


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (reducing pending partial sums) or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def global_token_count(count: int, dims: ParallelDims) -> int:
    """This rank's host count of the step's valid labels summed over the ranks that hold different tokens (data
    parallel x context parallel; a collective of that group: call it on every rank). One all-reduce of a host int64
    (the groups always include gloo for host tensors): the device is not waited for."""
    if dims.world_size == 1 or dims.dp * dims.cp == 1:
        return count
    total = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dims.token_mesh.get_group())
    return int(total)


def in_loss_form(t: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor `t` in the form of `loss`: replicated over the loss's mesh for the loss-parallel cross
    entropy's DTensor (t is the same on every tp rank), else as it is."""
    if isinstance(loss, DTensor):
        return DTensor.from_local(t, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return t


def mean_loss(loss: torch.Tensor | None, dims: ParallelDims) -> float:
    """The step's loss averaged over the data-parallel ranks (a collective: call it on every rank).

    `loss` is None on ranks without the last pipeline stage; every tp rank of the last stage holds the same value,
    and each rank holding different tokens (dp x cp of them) holds dp x cp times its share of the step's loss (its
    summed losses over the step's valid-label count: trainer/loss.py), so the world sum of the holders' losses
    divided by dp x tp x cp is the step's loss. A per-rank mean (the MoE auxiliary loss) gives the ranks' mean.
    """
    # On the host in float64: the groups always include gloo for host tensors (process_group.py), and this runs on
    # log steps only, where the value is read anyway.
    value = torch.zeros((), dtype=torch.float64) if loss is None else plain_tensor(loss.detach()).double().cpu()
    if dims.world_size == 1:
        return float(value)
    total = value.reshape(1)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total) / (dims.dp * dims.tp * dims.cp)


def _by_mesh(tensors: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """The tensors grouped by (mesh, placements) for DTensors, by device for plain tensors."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        key = (t.device_mesh, tuple(t.placements)) if hasattr(t, "device_mesh") else ("plain", t.device)
        groups.setdefault(key, []).append(t)
    return groups


def grad_norm(parameters: Iterable[torch.Tensor], dims: ParallelDims, foreach: bool = True,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Global L2 norm of all gradients of the model, whatever the layout (a collective under FSDP/TP/PP).

    `device` holds the zero of a rank without gradients.
    """
    # Gradients on different meshes (or plain tensors) cannot be stacked together: take each group's norm.
    groups = _by_mesh([p.grad for p in parameters if p.grad is not None])
    # Summed where the gradients live: a zero made on the host would be a blocking copy that waits for the backward.
    total_sq = None
    for group in groups.values():
        square = plain_tensor(torch.nn.utils.get_total_norm(group, 2.0, foreach=foreach)).float().pow(2)
        total_sq = square if total_sq is None else total_sq + square.to(total_sq.device)
    if total_sq is None:  # no gradients on this rank
        total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if dims.pp_enabled:
        # Each pipeline rank holds different layers: the squares add up over the pp group (on the gradients'
        # device, so the step does not wait for a copy to the host).
        total_sq = total_sq.reshape(1)
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=dims.pp_mesh.get_group())
        total_sq = total_sq.reshape(())
    return total_sq.sqrt()


def clip_grad_norm_(parameters: list[torch.Tensor], max_norm: float, dims: ParallelDims,
                    foreach: bool = True) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm (max_norm <= 0: measure only); returns the norm."""
    device = parameters[0].device if parameters else "cpu"
    total = grad_norm(parameters, dims, foreach=foreach, device=device)
    if max_norm > 0:
        # Per mesh: one foreach op cannot take DTensors of different meshes (expert-parallel experts and FSDP's).
        for group in _by_mesh([p for p in parameters if p.grad is not None]).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


def loss_parallel_context(dims: ParallelDims, enabled: bool):
    """torch's loss_parallel when the output is vocab-sharded by TP (cross entropy on sharded logits), else a no-op.

    Both the loss and its backward must run inside it.
    """
    if dims.tp_enabled and enabled:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()

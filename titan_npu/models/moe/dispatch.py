"""Expert parallelism: the token exchange of a MoE layer whose experts are split over the ranks of a group.

Rank r holds experts [r x L, (r + 1) x L) (L = n_experts / ep). Each rank sends the copies of its tokens, sorted
by expert, to the ranks that hold those experts (all_to_all_single, the per-rank counts exchanged first), runs its
local experts as one grouped GEMM over what it received, and sends the outputs back by the reverse exchange.
Both exchanges carry autograd (the backward of one is the other).

all_to_all_single takes its split sizes as host integers: the counts are read to the host once per MoE layer and
forward (the one device-to-host read of an expert-parallel step; a dropless exchange has data-dependent sizes).

With a capacity factor the exchange has fixed sizes and no host read: each rank fills [n_experts, capacity, dim]
slots with its tokens (as the single-rank capacity path does; each rank's tokens capped per expert, as under FSDP),
sends each ep rank the slots of its experts in one equal-split all_to_all, runs its experts as one batched matmul
over [local experts, ep x capacity, dim] and sends the outputs back the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x, whose gradient is multiplied by `scale`."""
    return _ScaleGrad.apply(x, scale)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_grad(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x, whose gradient is summed over the ranks of `group` (each holds a partial gradient of the same x)."""
    return _AllReduceGrad.apply(x, group)


def fill_slots(x: torch.Tensor, expert: torch.Tensor, slot: torch.Tensor, n_experts: int, capacity: int
               ) -> torch.Tensor:
    """[n_experts, capacity, dim]: row i of x at slot[i] of expert[i] (slot == capacity: dropped), empty slots zero."""
    # One spill slot past the capacity takes the dropped rows (summed there, never computed).
    slots = x.new_zeros(n_experts, capacity + 1, x.shape[1]).index_put((expert, slot), x, accumulate=True)
    return slots[:, :capacity]


def read_slots(out: torch.Tensor, expert: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Row i: out[expert[i], slot[i]] of out [n_experts, capacity, dim]; zeros for the dropped (slot == capacity)."""
    return F.pad(out, (0, 0, 0, 1))[expert, slot]  # the spill slot reads back zeros


def run_experts_parallel(experts: torch.nn.Module, routed: torch.Tensor, counts: torch.Tensor,
                         group: dist.ProcessGroup) -> torch.Tensor:
    """routed [N, dim]: this rank's token copies sorted by global expert, counts [n_experts] their rows per expert.
    Returns the experts' outputs [N, dim] in the same order, computed by the ranks that hold the experts."""
    ep = dist.get_world_size(group)
    n_experts = counts.shape[0]
    local = n_experts // ep
    # received[i, l]: rows rank i sends to local expert l of this rank.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send_rows = counts.view(ep, local).sum(1)
    # The one host read of the exchange: both split lists in one copy.
    sizes = torch.cat([send_rows, received]).tolist()
    input_splits, received_counts = sizes[:ep], sizes[ep:]
    output_splits = [sum(received_counts[i * local:(i + 1) * local]) for i in range(ep)]
    rows = all_to_all_single_autograd(routed, output_splits, input_splits, group)
    # Rows arrive grouped by source rank, then by local expert: regroup them by local expert (stable).
    received = received.view(ep, local)
    expert_of_row = torch.arange(local, device=routed.device).repeat(ep).repeat_interleave(received.reshape(-1))
    order = torch.argsort(expert_of_row, stable=True)
    ends = received.sum(0).cumsum(0).to(torch.int32)
    out_grouped = experts(rows[order], ends, max_group_rows=max(1, sum(received_counts)))
    out = torch.empty_like(out_grouped).index_copy(0, order, out_grouped)
    return all_to_all_single_autograd(out, input_splits, output_splits, group)


def run_experts_parallel_padded(experts: torch.nn.Module, routed: torch.Tensor, expert: torch.Tensor,
                                slot: torch.Tensor, capacity: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Capacity routing over the ep ranks of `group`: row i of routed [N, dim] goes to `slot[i]` of global expert
    `expert[i]`'s `capacity` slots (slot == capacity: dropped). Returns [N, dim], zeros for the dropped rows."""
    ep = dist.get_world_size(group)
    n_experts, dim = experts.w1.shape[0], routed.shape[1]
    local = n_experts // ep
    slots = fill_slots(routed, expert, slot, n_experts, capacity).reshape(n_experts * capacity, dim)
    # Equal splits: rank j gets the slots of its experts [j x local, (j + 1) x local) from every rank.
    received = all_to_all_single_autograd(slots, None, None, group)
    received = received.view(ep, local, capacity, dim).transpose(0, 1).reshape(local, ep * capacity, dim)
    out = experts.forward_batched(received)
    out = out.view(local, ep, capacity, dim).transpose(0, 1).reshape(n_experts * capacity, dim)
    returned = all_to_all_single_autograd(out, None, None, group)
    return read_slots(returned.view(n_experts, capacity, dim), expert, slot)

"""Expert parallelism: the token exchange of a MoE layer whose experts are split over the ranks of a group.

Rank r holds experts [r x L, (r + 1) x L) (L = n_experts / ep). Each rank sends the copies of its tokens, sorted
by expert, to the ranks that hold those experts (all_to_all_single, the per-rank counts exchanged first), runs its
local experts as one grouped GEMM over what it received, and sends the outputs back by the reverse exchange.
Both exchanges carry autograd (the backward of one is the other).

all_to_all_single takes its split sizes as host integers: the counts are read to the host once per MoE layer and
forward (the one device-to-host read of an expert-parallel step; a dropless exchange has data-dependent sizes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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

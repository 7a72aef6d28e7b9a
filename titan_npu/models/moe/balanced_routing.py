"""Balanced routing for the dry run: the expert-parallel exchange with the split sizes an even load would give.

Under expert parallelism the token exchange's split sizes are routed counts, values the dry run's fake tensors do not
hold: it assumes every expert receives tokens x top_k / n_experts copies from every rank (the planner's activation
and all-to-all estimates assume the same) and runs the exchange with those sizes. A MoE family's ModelSpec names
balanced_routing; planner/dry_run.py reaches it through the spec.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.models.moe.layer import MoE


def balanced_rows(rows: int, n_experts: int) -> list[int]:
    """Rows of `rows` routed copies each expert receives from one rank when routing is balanced (the first
    rows % n_experts experts one more)."""
    return [rows // n_experts + (1 if e < rows % n_experts else 0) for e in range(n_experts)]


def balanced_exchange(experts: nn.Module, routed: torch.Tensor, counts: torch.Tensor,
                      group: dist.ProcessGroup) -> torch.Tensor:
    """The expert-parallel exchange (models/moe/dispatch.py) with balanced routing's split sizes instead of the
    routed counts: the same all-to-alls and grouped GEMM, on shapes fake tensors can carry. Rank r holds experts
    [r x L, (r + 1) x L) (L = n_experts / ep) and every rank routes as many rows."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    local = counts.shape[0] // ep
    per_expert = balanced_rows(routed.shape[0], counts.shape[0])
    send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ep)]
    mine = per_expert[rank * local:(rank + 1) * local]
    receive = [send[rank]] * ep
    received = all_to_all_single_autograd(routed, receive, send, group)
    ends = torch.tensor(mine, dtype=torch.int64).mul(ep).cumsum(0).to(torch.int32)
    out = experts(received, ends, max_group_rows=max(1, max(mine) * ep))
    return all_to_all_single_autograd(out, send, receive, group)


@contextlib.contextmanager
def balanced_routing(parts: list[nn.Module]) -> Iterator[None]:
    """The MoE layers of `parts` exchange their tokens with balanced routing's split sizes while the context is
    open (each layer's `exchange` seam; restored on exit)."""
    layers = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
    saved = [layer.exchange for layer in layers]
    for layer in layers:
        layer.exchange = balanced_exchange
    try:
        yield
    finally:
        for layer, exchange in zip(layers, saved):
            layer.exchange = exchange

"""The MoE feed-forward: route, sort the token copies by expert, run the experts as grouped GEMMs, weight and sum
each token's top-k outputs, add the shared expert.

Dropless by default: every expert takes every token routed to it (the grouped GEMM's groups have any size). With a
capacity factor an expert takes at most `capacity` assignments per forward, the earliest tokens first; the rest
are dropped (counted, and their weight lost: the residual carries the token) and the experts run as one batched
matmul over [n_experts, capacity, dim]. Nothing here reads a device value on the host, except the split sizes of
the token exchange under expert parallelism (dispatch.py: experts split over ranks, dropless only).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from titan_npu.models.decoder.model import FeedForward
from titan_npu.models.init import ParamInit, prefixed
from titan_npu.models.moe.args import MoEArgs
from titan_npu.models.moe.dispatch import run_experts_parallel
from titan_npu.models.moe.experts import GroupedExperts
from titan_npu.models.moe.group_router import GroupRouter
from titan_npu.models.moe.router import Router

# What a MoE layer reports of one forward: (assignments per expert [n_experts] fp32, detached; router probability
# summed over the tokens [n_experts] fp32, with its gradient; dropped assignments, a 0-dim int64 tensor).
RoutingStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class MoE(nn.Module):
    """x [..., dim] -> (out [..., dim], RoutingStats)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = GroupRouter(args) if args.router == "sigmoid_group" else Router(args)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.ffn_dim)
        self.shared_experts = FeedForward(args.dim, args.shared_ffn_dim) if args.shared_ffn_dim else None
        # The group the experts are split over (expert parallelism, dispatch.py); None = every expert here.
        self.ep_group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tokens, top_k, n_experts = x.shape[0], self.args.top_k, self.args.n_experts
        weights, experts, probs = self.router(x)
        # Token copies sorted by expert (stable: within an expert, in token order).
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_expert = flat[order]
        counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        ends = counts.cumsum(0)
        routed = x[order // top_k]
        if self.ep_group is not None:
            out_sorted = run_experts_parallel(self.experts, routed, counts, self.ep_group)
            dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        elif self.args.capacity_factor is None:
            out_sorted = self.experts(routed, ends.to(torch.int32), max_group_rows=n_tokens)
            dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        else:
            capacity = self.args.capacity(n_tokens)
            slot = torch.arange(flat.shape[0], device=x.device) - (ends - counts)[sorted_expert]
            kept = slot < capacity
            out_sorted = self.experts.forward_padded(routed, sorted_expert, torch.where(kept, slot, capacity),
                                                     capacity)
            dropped = (~kept).sum()
        # Back to token order: row i of out is copy i of token i // top_k.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=x.device))
        out = out_sorted[inverse].view(n_tokens, top_k, -1)
        out = (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape), (counts.float(), probs.sum(dim=0), dropped)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """The router, the experts and the shared expert (their down projections ~ N(0, init_std))."""
        inits = {**prefixed("router", self.router.param_inits()),
                 **prefixed("experts", self.experts.param_inits(init_std))}
        if self.shared_experts is not None:
            inits.update(prefixed("shared_experts", self.shared_experts.param_inits(init_std)))
        return inits

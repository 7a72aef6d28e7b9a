"""The MoE feed-forward: route, sort the token copies by expert, run the experts as grouped GEMMs, weight and sum
each token's top-k outputs, add the shared expert.

Dropless by default: every expert takes every token routed to it (the grouped GEMM's groups have any size). With a
capacity factor an expert takes at most `capacity` assignments per forward, the earliest tokens first; the rest
are dropped (counted, and their weight lost: the residual carries the token) and the experts run as one batched
matmul over [n_experts, capacity, dim]. Nothing here reads a device value on the host, except the split sizes of
the dropless token exchange under expert parallelism (dispatch.py: experts split over ranks; with a capacity the
exchange has fixed sizes).

Under tensor parallelism (parallelize.py: `tp_mesh` set) the layer takes the sequence-parallel shard of its input,
gathers the whole sequence, routes every token on every tp rank (the router is replicated: the same choices
everywhere), runs each expert on this rank's slice of its ffn dim (w1 / w3 split on their output rows, w2 on its
input columns) and reduce-scatters the partial outputs back onto the sequence. The gradients that meet the experts'
partial sums are completed by a sum over the tp ranks: the routed input's (the experts' part of the input's
gradient; the router's part is whole on every rank) and the top-k weights' (so the router's gradient, aux loss
included, is whole and the same on every rank). A shared expert is split as the dense SwiGLU is (w1 / w3 column,
w2 row parallel), its partial output added before the reduce-scatter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_npu import ops
from titan_npu.models.decoder.model import FeedForward, Linear
from titan_npu.models.init import ParamInit, prefixed, trunc_normal
from titan_npu.models.moe.args import MoEArgs
from titan_npu.models.moe.dispatch import all_reduce_grad, run_experts_parallel, run_experts_parallel_padded
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
        self.experts = GroupedExperts(args.n_experts, args.dim, args.ffn_dim, bias=args.expert_bias,
                                      swiglu_limit=args.swiglu_limit, swiglu_alpha=args.swiglu_alpha)
        self.shared_experts = FeedForward(args.dim, args.shared_ffn_dim) if args.shared_ffn_dim else None
        self.shared_gate = Linear(args.dim, 1) if args.shared_gate else None
        # The group the experts are split over (expert parallelism, dispatch.py); None = every expert here.
        self.ep_group: ProcessGroup | None = None
        # The tensor-parallel mesh the experts' ffn dim is split over (see the module docstring); None = whole.
        self.tp_mesh: DeviceMesh | None = None
        # The dropless expert-parallel exchange (dispatch.py); the dry run installs one with balanced routing's split
        # sizes, which fake tensors can carry (planner/dry_run.py).
        self.exchange = run_experts_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        tp_group = None
        if self.tp_mesh is not None:  # x: the sequence-parallel shard [B, S / tp, dim], a DTensor Shard(1)
            tp_group = self.tp_mesh.get_group()
            x = x.redistribute(self.tp_mesh, [Replicate()]).to_local()
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tokens, n_experts = x.shape[0], self.args.n_experts
        weights, experts, probs = self.router(x)
        # Token copies sorted by expert (stable: within an expert, in token order).
        flat = experts.reshape(-1)
        routed, order = ops.moe_permute(x, experts)
        counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        ends = counts.cumsum(0)
        if tp_group is not None:
            routed, weights = all_reduce_grad(routed, tp_group), all_reduce_grad(weights, tp_group)
        if self.args.capacity_factor is None:
            if self.ep_group is not None:
                out_sorted = self.exchange(self.experts, routed, counts, self.ep_group)
            else:
                out_sorted = self.experts(routed, ends.to(torch.int32), max_group_rows=n_tokens)
            dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        else:
            capacity = self.args.capacity(n_tokens)
            sorted_expert = flat[order]
            slot = torch.arange(flat.shape[0], device=x.device) - (ends - counts)[sorted_expert]
            kept = slot < capacity
            slot = torch.where(kept, slot, capacity)
            if self.ep_group is not None:
                out_sorted = run_experts_parallel_padded(self.experts, routed, sorted_expert, slot, capacity,
                                                         self.ep_group)
            else:
                out_sorted = self.experts.forward_padded(routed, sorted_expert, slot, capacity)
            dropped = (~kept).sum()
        # Back to token order, the copies of each token weighted and summed.
        out = ops.moe_unpermute(out_sorted, order, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if isinstance(shared, DTensor):  # tensor parallel: this rank's partial sum, whose gradient is whole
                shared = shared.to_local(grad_placements=[Replicate()])
            if self.shared_gate is not None:
                gate = torch.sigmoid(self.shared_gate(x))
                # Tensor parallel: the gate meets a partial sum, so its gradient is completed over the ranks.
                shared = shared * (gate if tp_group is None else all_reduce_grad(gate, tp_group))
            out = out + shared
        out = out.view(shape)
        if tp_group is not None:  # partial sums over the ffn slices -> this rank's sequence shard, summed
            out = DTensor.from_local(out, self.tp_mesh, [Partial()], run_check=False)
            out = out.redistribute(self.tp_mesh, [Shard(1)]).to_local()
        return out, (counts.float(), probs.sum(dim=0), dropped)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """The router, the experts and the shared expert (their down projections ~ N(0, init_std))."""
        inits = {**prefixed("router", self.router.param_inits()),
                 **prefixed("experts", self.experts.param_inits(init_std))}
        if self.shared_experts is not None:
            inits.update(prefixed("shared_experts", self.shared_experts.param_inits(init_std)))
        if self.shared_gate is not None:
            inits["shared_gate.weight"] = trunc_normal(0.02)
        return inits

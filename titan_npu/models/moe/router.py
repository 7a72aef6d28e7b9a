"""Token-choice routing: a linear gate, a softmax over the experts, the top-k of each token.

The weights a token gives its experts are the softmax probabilities of the chosen ones, renormalised to sum to 1
when norm_topk_prob (Qwen3-MoE's published models do). An optional per-expert score bias (aux-loss-free balancing,
DeepSeek-V3) shifts which experts are chosen but not the weights they get; balance.update_score_bias moves it.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_npu import ops
from titan_npu.models.decoder.model import Linear
from titan_npu.models.init import ParamInit, constant, trunc_normal
from titan_npu.models.moe.args import MoEArgs


class Router(nn.Module):
    """x [T, dim] -> (weights [T, top_k] in the gate's dtype, experts [T, top_k], probabilities [T, n_experts] fp32)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(args.dim, args.n_experts, bias=args.router_bias)
        self.score_bias: torch.Tensor | None
        if args.score_bias:
            self.register_buffer("score_bias", torch.zeros(args.n_experts, dtype=torch.float32))
        else:
            self.score_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        if self.score_bias is None:
            probs, experts = ops.moe_topk_softmax(logits, self.top_k)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            experts = torch.topk(probs + self.score_bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)  # the weights' gradient flows through this gather
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts, probs

    def param_inits(self) -> dict[str, ParamInit]:
        """The gate ~ N(0, 0.02), its bias (gpt-oss) 0 (the score bias is a buffer: zero at init, see
        reset_score_bias)."""
        inits = {"gate.weight": trunc_normal(0.02)}
        if self.gate.bias is not None:
            inits["gate.bias"] = constant(0.0)
        return inits

    @torch.no_grad()
    def reset_score_bias(self) -> None:
        """Zero the score bias, if any (a model allocated after the meta device holds garbage there until this)."""
        if self.score_bias is not None:
            self.score_bias.zero_()

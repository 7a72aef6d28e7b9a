"""Group-limited sigmoid routing (DeepSeek-V3): each expert's score is the sigmoid of its gate logit; the experts
are cut into n_groups groups, a group scores the sum of its two best experts, a token picks its top_k experts
among the topk_groups best groups only; the weights are the chosen scores (renormalised to sum to 1 when
norm_topk_prob) times route_scale.

The per-expert score bias (aux-loss-free balancing, always present here: Hugging Face's e_score_correction_bias)
is added to the scores for the choice of groups and experts only, never to the weights; it is a persistent buffer
(saved with the weights) that balance.update_score_bias moves between steps. sequence_balance_loss is the paper's
optional sequence-wise balance loss. The router computes in fp32, as
transformers' DeepseekV3TopkRouter does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_npu.models.decoder.model import Linear
from titan_npu.models.init import ParamInit, trunc_normal
from titan_npu.models.moe.args import MoEArgs


class GroupRouter(nn.Module):
    """x [T, dim] -> (weights [T, top_k] in x's dtype, experts [T, top_k], scores [T, n_experts] fp32): the output
    contract of router.Router, the sigmoid scores standing for the probabilities."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.norm_topk_prob = args.norm_topk_prob
        self.n_groups = args.n_groups
        self.topk_groups = args.topk_groups
        self.route_scale = args.route_scale
        self.gate = Linear(args.dim, args.n_experts)
        self.register_buffer("score_bias", torch.zeros(args.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = self.gate.weight
        if isinstance(weight, DTensor):  # replicated over tensor-parallel ranks that route the same tokens
            weight = weight.to_local()
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), weight.float()))
        choice = scores + self.score_bias
        if self.n_groups > 1:
            grouped = choice.unflatten(-1, (self.n_groups, -1))  # [T, groups, experts per group]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.route_scale).to(x.dtype), experts, scores

    def param_inits(self) -> dict[str, ParamInit]:
        """The gate ~ N(0, 0.02) (the score bias is a buffer: zero at init, see reset_score_bias)."""
        return {"gate.weight": trunc_normal(0.02)}

    @torch.no_grad()
    def reset_score_bias(self) -> None:
        """Zero the score bias (a model allocated after the meta device holds garbage there until this)."""
        self.score_bias.zero_()


def sequence_balance_loss(experts: torch.Tensor, scores: torch.Tensor, n_sequences: int,
                          context: Any = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one MoE layer: sum_i f_i P_i per sequence, averaged over the
    sequences, f_i = n_experts / (top_k T) x the assignments to expert i among the sequence's T tokens, P_i the mean
    over those tokens of expert i's score normalised over the experts. experts [N, top_k], scores [N, n_experts]
    (N = n_sequences x T tokens, in sequence order); gradients flow through the scores only. Under context
    parallelism (`context`: parallel/context_parallel.py's, whose ranks hold equal shares of each sequence) f counts
    every cp rank's tokens and P this rank's: the cp ranks' mean of the loss is the whole sequences'."""
    n_experts = scores.shape[-1]
    scores = scores.view(n_sequences, -1, n_experts)
    mean_share = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)  # [sequences, n_experts]
    picks = experts.view(n_sequences, -1)
    counts = torch.zeros_like(mean_share).scatter_add_(1, picks, torch.ones_like(picks, dtype=mean_share.dtype))
    picked = picks.shape[1]  # top_k x T
    if context is not None:
        counts, picked = context.token_sum(counts), picked * context.size
    fraction = counts * n_experts / picked
    return (fraction * mean_share).sum(dim=-1).mean()

"""Load balancing: the auxiliary loss exactly as transformers computes it for Qwen3-MoE (load_balancing_loss_func,
Switch Transformer eq. 4-6, pooled over every MoE layer of the model), and the bias update of aux-loss-free
balancing (DeepSeek-V3) for routers with a score bias."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_balancing_loss(tokens_per_expert: Sequence[torch.Tensor], prob_sums: Sequence[torch.Tensor],
                        rows_per_layer: int) -> torch.Tensor:
    """n_experts x sum_e f_e P_e over all layers together: f_e the fraction of the top-k assignments (summed over
    layers, divided by layers x rows) that went to expert e, P_e its mean router probability likewise; gradients
    flow through P only. tokens_per_expert / prob_sums: one [n_experts] tensor per MoE layer."""
    return pooled_load_balancing_loss(torch.stack(list(tokens_per_expert)).sum(0),
                                      torch.stack(list(prob_sums)).sum(0), rows_per_layer * len(tokens_per_expert))


def pooled_load_balancing_loss(counts: torch.Tensor, prob_sums: torch.Tensor, rows: int) -> torch.Tensor:
    """The same loss from the layers' pooled sums: counts [n_experts] (assignments, summed over the layers), prob_sums
    [n_experts] (router probabilities, summed over the tokens and layers), rows = tokens per layer x layers."""
    fraction = counts.detach().float() / rows
    mean_prob = prob_sums.float() / rows
    return counts.shape[0] * torch.sum(fraction * mean_prob)


@torch.no_grad()
def update_score_bias(score_bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing: raise the bias of experts that took fewer tokens than the mean, lower it for
    those that took more, by `rate` (in place, on the device: no host read)."""
    load = tokens_per_expert.float()
    score_bias.add_(torch.sign(load.mean() - load), alpha=rate)

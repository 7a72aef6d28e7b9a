"""The auxiliary loss and expert load of a model that routes tokens (MoE), for the step and its log line.

A model says it has them by its methods (models/qwen3_moe/model.py): `auxiliary_loss()`, the term its last forward
adds to the optimised loss (None: nothing), and `routing_metrics()`, device tensors of that forward (aux_loss,
expert_tokens [MoE layers, n_experts], dropped_tokens under a capacity). A model without them (every dense
family) makes this inert. The logged `loss` stays the cross entropy; the step's values accumulate on the device
and are read on the host only at log steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.models.moe.balance import update_score_bias
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.reduce import mean_loss


class RoutingMeter:
    """Adds the model's auxiliary loss to each micro-batch's loss and sums what one step routed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model if hasattr(model, "routing_metrics") else None
        self.sums: dict[str, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """Whether the model reports routing (a MoE model)."""
        return self.model is not None

    def begin_step(self) -> None:
        """Forget the previous step's values."""
        self.sums = {}

    def add_auxiliary(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """The loss to optimise for one micro-batch (its share `scale` of the step): the cross entropy plus the
        model's auxiliary term of the forward that just ran; notes that forward's routing."""
        if self.model is None:
            return loss
        for key, value in self.model.routing_metrics().items():
            value = value * scale if key in ("aux_loss", "mtp_loss") else value
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        aux = self.model.auxiliary_loss()
        return loss if aux is None else loss + aux

    def record(self, dims: ParallelDims) -> dict[str, Any]:
        """The log step's fields (collectives over the ranks; call on every rank): aux_loss (the unweighted
        load-balancing loss, mean over micro-batches and data-parallel ranks), expert_load_max_mean (over the MoE
        layers, the mean of max / mean tokens per expert), expert_load_per_layer, and dropped_tokens with a capacity."""
        if self.model is None or not self.sums:
            return {}
        out: dict[str, Any] = {"aux_loss": mean_loss(self.sums["aux_loss"], dims)}
        tokens = self.sums["expert_tokens"].detach().double().cpu()
        if dims.world_size > 1:  # every rank's tokens (tensor-parallel ranks repeat theirs: max / mean is unchanged)
            dist.all_reduce(tokens)
        per_layer = (tokens.max(dim=1).values / tokens.mean(dim=1).clamp(min=1e-9)).tolist()
        out["expert_load_max_mean"] = sum(per_layer) / len(per_layer)
        out["expert_load_per_layer"] = [round(v, 4) for v in per_layer]
        if "mtp_loss" in self.sums:  # multi-token prediction's cross entropy (DeepSeek-V3), mean like aux_loss
            out["mtp_loss"] = mean_loss(self.sums["mtp_loss"], dims)
        if "dropped_tokens" in self.sums:  # the model routes with a capacity
            dropped = self.sums["dropped_tokens"].detach().double().cpu().reshape(1)
            if dims.world_size > 1:
                dist.all_reduce(dropped)
            out["dropped_tokens"] = int(dropped.item())
        return out


def update_score_biases(meter: RoutingMeter, dims: ParallelDims) -> None:
    """Aux-loss-free balancing, after an optimizer step: each MoE layer's router score bias steps by the model's
    score_bias_rate toward an even load, the load of the step summed over the data-parallel ranks on the device (a
    collective: call it on every rank), so every rank's bias stays identical. Not part of any gradient; inert for a
    model without score biases or with the rate 0."""
    model = meter.model
    rate = getattr(getattr(model, "args", None), "score_bias_rate", 0.0)
    if not rate or not hasattr(model, "score_biases") or "expert_tokens" not in meter.sums:
        return
    tokens = meter.sums["expert_tokens"].detach().clone()
    if dims.world_size > 1:
        dist.all_reduce(tokens)
    for bias, load in zip(model.score_biases(), tokens):
        update_score_bias(bias, load, rate)

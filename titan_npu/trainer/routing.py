"""The auxiliary loss and expert load of a model that routes tokens (MoE), for the step and its log line.

A model says it has them by its methods (models/moe_decoder/model.py): `auxiliary_loss()`, the term its last forward
adds to the optimised loss (None: nothing), and `routing_metrics()`, device tensors of that forward (aux_loss,
expert_tokens [MoE layers, n_experts], dropped_tokens under a capacity). A model without them (every dense
family) makes this inert. The logged `loss` stays the cross entropy; the step's values accumulate on the device
and are read on the host only at log steps.

Under pipeline parallelism the schedule runs the forwards: each stage's routing is noted by a forward hook, and the
loss function of the last stage, which pools every MoE layer (the stages carry their routing sums on), adds the
auxiliary term. The schedule's first step also runs a forward on uninitialised inputs to learn the shapes the stages
exchange; a step keeps only each stage's last forwards, one per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.models.registry import spec_of
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.reduce import in_loss_form, mean_loss


class RoutingMeter:
    """Adds the model's auxiliary loss to each micro-batch's loss and sums what one step routed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model if hasattr(model, "routing_metrics") else None
        self.sums: dict[str, torch.Tensor] = {}
        # Under pipeline parallelism: each stage module's routing of this step, one entry per forward.
        self.stage_forwards: dict[int, list[dict[str, torch.Tensor]]] = {}
        self.parts: list[nn.Module] = []
        self.n_microbatches = 0

    @property
    def active(self) -> bool:
        """Whether the model reports routing (a MoE model)."""
        return self.model is not None

    def begin_step(self) -> None:
        """Forget the previous step's values."""
        self.sums = {}
        self.stage_forwards = {}

    def _add(self, metrics: dict[str, torch.Tensor], scale: float) -> None:
        """Add one forward's routing metrics, a share `scale` of the step, to the step's sums."""
        for key, value in metrics.items():
            value = value * scale if key in ("aux_loss", "mtp_loss") else value
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add_auxiliary(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """The loss to optimise for one micro-batch (its share `scale` of the step): the cross entropy plus the
        model's auxiliary term of the forward that just ran; notes that forward's routing."""
        if self.model is None:
            return loss
        self._add(self.model.routing_metrics(), scale)
        aux = self.model.auxiliary_loss()
        return loss if aux is None else loss + in_loss_form(aux, loss)

    def pipeline_loss(self, parts: list[nn.Module], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      n_microbatches: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The loss function of a pipeline schedule over this rank's stage modules `parts`: loss_fn plus the
        auxiliary term of the last stage; every part's training forwards (one per micro-batch) are noted."""
        if self.model is None:
            return loss_fn
        self.n_microbatches = n_microbatches
        self.parts = parts

        def note_forward(module: nn.Module, args: tuple, output: Any) -> None:
            if module.training:
                self.stage_forwards.setdefault(id(module), []).append(module.routing_metrics())

        for part in parts:
            part.register_forward_hook(note_forward)
        last = next((part for part in parts if part.output is not None), None)

        def loss_with_auxiliary(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(output, target)
            aux = last.auxiliary_loss()
            # The schedule reports what this returns: its value stays the cross entropy (+ aux - aux = + 0), its
            # gradient is that of cross entropy + aux.
            return loss if aux is None else loss + in_loss_form(aux - aux.detach(), loss)

        return loss_with_auxiliary

    def record(self, dims: ParallelDims) -> dict[str, Any]:
        """The log step's fields (collectives over the ranks; call on every rank): aux_loss (the unweighted
        load-balancing loss, mean over micro-batches and data-parallel ranks), expert_load_max_mean (over the MoE
        layers, the mean of max / mean tokens per expert), expert_load_per_layer, and dropped_tokens with a capacity."""
        for forwards in self.stage_forwards.values():  # the pipeline's: its micro-batches' forwards
            for metrics in forwards[-self.n_microbatches:]:
                self._add(metrics, 1.0 / self.n_microbatches)
        self.stage_forwards = {}
        if self.model is None or not self.sums:
            return {}
        # Only the ranks of the last pipeline stage hold the aux loss (pooled over every stage's layers).
        out: dict[str, Any] = {"aux_loss": mean_loss(self.sums.get("aux_loss"), dims)}
        tokens = self.sums["expert_tokens"].detach().double().cpu()
        if dims.world_size > 1:  # every rank's tokens and stages' layers (tp ranks repeat them: a ratio, unchanged)
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
            out["dropped_tokens"] = int(dropped.item()) // dims.tp  # the tp ranks route the same tokens
        return out


def update_score_biases(meter: RoutingMeter, dims: ParallelDims, skip: torch.Tensor | bool = False) -> None:
    """Aux-loss-free balancing, after an optimizer step: each MoE layer's router score bias steps by the family's
    rate (ModelSpec.bias_update_rate) toward an even load, the load of the step summed over the data-parallel ranks
    on the device (a collective: call it on every rank), so every rank's bias stays identical. Under pipeline
    parallelism each stage moves the biases of the layers it holds, from their load summed over the stage's
    data-parallel ranks. `skip`: the step's update was skipped (True, or a 0-d device flag at 1.0): the biases stay
    too. Not part of any gradient; inert for a model without score biases or with the rate 0."""
    model = meter.model
    args = getattr(model, "args", None)
    rate = 0.0 if args is None else spec_of(args).bias_update_rate(args)
    if not rate or not hasattr(model, "score_biases") or skip is True:
        return
    update = spec_of(model.args).update_score_bias
    if meter.parts and dims.pp_enabled:  # the pipeline's stages: each its own layers' load, over its token ranks
        group = dims.token_mesh.get_group() if dims.dp * dims.cp > 1 else None
        for part in meter.parts:
            forwards = meter.stage_forwards.get(id(part), [])[-meter.n_microbatches:]
            if forwards and forwards[0]:
                tokens = torch.stack([f["expert_tokens"] for f in forwards]).sum(dim=0)
                _move_biases(update, part.score_biases(), tokens, rate, skip, group)
        return
    if "expert_tokens" in meter.sums:
        _move_biases(update, model.score_biases(), meter.sums["expert_tokens"], rate, skip,
                     dist.group.WORLD if dims.world_size > 1 else None)


def _move_biases(update: Callable[[torch.Tensor, torch.Tensor, float], None], biases: dict[int, torch.Tensor],
                 tokens: torch.Tensor, rate: float, skip: torch.Tensor | bool, group: dist.ProcessGroup | None) -> None:
    """Step each bias (by its row of `tokens` [MoE layers, n_experts]) with the family's `update` by `rate` from that
    row's load, summed over `group` (None: this rank's); a device flag `skip` at 1.0 zeroes the load, which moves no
    bias."""
    tokens = tokens.detach().clone()
    if group is not None:
        dist.all_reduce(tokens, group=group)
    if isinstance(skip, torch.Tensor):
        tokens = tokens * (1 - skip)
    for row, bias in biases.items():
        update(bias, tokens[row], rate)

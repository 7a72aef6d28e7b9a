"""Pipeline parallelism with torch.distributed.pipelining: stage placement, schedules, and one training step.

Each pp rank runs one stage (GPipe, 1F1B), several looped ones (Interleaved1F1B, InterleavedZeroBubble: rank r runs
stages r, r + pp, r + 2 pp, ...) or two in a V (ZBVZeroBubble, DualPipeV: stages r and 2 pp - 1 - r); the schedule
is torch's own class of that name. A step's local batch (batch_size x gradient_accumulation_steps sequences) is split
into pp_microbatches microbatches; the schedule averages the gradients over them, so a step is the same
optimisation step as without pipelining.

Per-microbatch side data (a batch's packed documents, data.document_mask) is split by the caller, one value per
microbatch, and every stage's forward of microbatch i gets value i by keyword argument: nothing is left on a module
between calls, so no schedule (interleaved, with activation checkpointing recomputing in backward) can hand one
microbatch another's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_npu.ops.documents import Documents
from titan_npu.parallel.arithmetic import leftover_stages, stage_ids_for_rank
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.layout import SINGLE_STAGE_SCHEDULES, pp_microbatches, pp_stages_per_rank
from titan_npu.parallel.reduce import plain_tensor

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def split_for_pipeline(spec: Any, model: nn.Module, dims: ParallelDims, cfg: JobConfig
                       ) -> tuple[list[int], list[nn.Module]]:
    """(stage ids, stage modules) of this rank, cut from a whole model built on the meta device by its family's
    split (spec: the ModelSpec's split_layers and build_stage; the leftover layers placed for the schedule,
    arithmetic.leftover_stages)."""
    per_rank = pp_stages_per_rank(cfg)
    n_stages = dims.pp * per_rank
    layers = spec.split_layers(len(model.layers), n_stages, leftover_stages(n_stages, cfg.parallel.pp_schedule))
    pp_rank, _ = dims.pp_coordinates()
    ids = stage_ids_for_rank(pp_rank, dims.pp, per_rank, cfg.parallel.pp_schedule)
    parts = [spec.build_stage(model, layers[i], is_first=i == 0, is_last=i == n_stages - 1) for i in ids]
    return ids, parts


class Pipeline:
    """The stages this rank runs and the schedule that drives them through one training step."""

    def __init__(self, stages: list, schedule, n_microbatches: int) -> None:
        self.stages = stages
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, documents: list[Documents] | None = None
             ) -> torch.Tensor | None:
        """Forward and backward of one local batch; the mean loss on the rank holding the last stage, else None.
        documents: each microbatch's (Documents.split), handed to every stage's forward of that microbatch."""
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        target = labels if self.has_last else None
        args = (inputs,) if self.has_first else ()
        kwargs = {} if documents is None else {_PER_MICROBATCH: [{"documents": d} for d in documents]}
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not self.has_last:
            return None
        return torch.stack([plain_tensor(loss.detach()) for loss in losses]).mean()


_PER_MICROBATCH = "per_microbatch_kwargs"


def _per_microbatch_kwargs(schedule_class: type) -> type:
    """schedule_class whose step also takes per_microbatch_kwargs, a list of keyword arguments per microbatch
    (already split: torch splits tensors by rows but hands every microbatch the same other objects)."""

    class Schedule(schedule_class):
        def _split_inputs(self, args: tuple, kwargs: dict | None = None) -> tuple[list, list]:
            kwargs = dict(kwargs or {})
            own = kwargs.pop(_PER_MICROBATCH, None)
            args_split, kwargs_split = super()._split_inputs(args, kwargs)
            if own is not None:
                kwargs_split = [{**shared, **mine} for shared, mine in zip(kwargs_split, own, strict=True)]
            return args_split, kwargs_split

    Schedule.__name__ = Schedule.__qualname__ = schedule_class.__name__
    return Schedule


def build_pipeline(
    parts: list[nn.Module],
    stage_ids: list[int],
    dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """PipelineStages for this rank's (parallelised, materialised) parts and the configured schedule."""
    from torch.distributed.pipelining import PipelineStage

    n_stages = dims.pp * pp_stages_per_rank(cfg)
    group = dims.pp_mesh.get_group()
    stages = [PipelineStage(part, i, n_stages, device, group=group) for i, part in zip(stage_ids, parts)]
    n_mb = pp_microbatches(cfg, dims)
    name = cfg.parallel.pp_schedule
    cls = _per_microbatch_kwargs(schedule_class(name))
    schedule = cls(stages[0] if name in SINGLE_STAGE_SCHEDULES else stages,
                   n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=True)
    return Pipeline(stages, schedule, n_mb)


def schedule_class(name: str) -> type:
    """torch.distributed.pipelining's schedule class of parallel.pp_schedule `name` (layout.PP_SCHEDULES)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(name)


class PartOptimizers(torch.optim.Optimizer):
    """One optimizer per model part, stepped as one (a rank of the interleaved schedule runs several stages).

    Checkpoints need an optimizer per part (`optimizers`); the trainer and the lr schedule see one optimizer whose
    param_groups are the parts' own group dicts, so a learning-rate change reaches every part.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        # Optimizer.__init__ would build new groups; share the parts' instead.
        self.optimizers = optimizers
        self.defaults = dict(optimizers[0].defaults)
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]
        self.state = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state_dict: dict) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state_dict[str(i)])


def build_part_optimizers(model_parts: list[nn.Module], build: Callable[[list[nn.Module]], torch.optim.Optimizer]
                          ) -> torch.optim.Optimizer:
    """build(parts) for a single part, else one optimizer per part behind PartOptimizers."""
    if len(model_parts) == 1:
        return build(model_parts)
    return PartOptimizers([build([part]) for part in model_parts])

"""A run's state as plain local tensors, for a recovering replica group to fetch from a live peer (fault tolerance).

Peer groups have the same layout, so rank r of one group holds the same shards as rank r of another: each rank
sends its own shards (DTensors as their local tensors, which any transport can carry) and the receiver rebuilds
them on its own mesh. The model and optimizer come in the flattened, FQN-keyed form of state.py; the lr schedule,
step, tokens seen, data position and the further Stateful objects come as they are.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titan_npu.checkpoint.state import _OPTIM_OPTIONS, RunState


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`local` as a shard of `template`'s DTensor (or itself, when the template is a plain tensor)."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local.to(template.device), template.device_mesh, template.placements,
                              shape=template.shape, stride=template.stride())


def live_state(run: RunState) -> dict[str, Any]:
    """This rank's part of the run, in local tensors and plain values (sent as is: the sender trains on after the
    transfer is done, which the transport waits for before the next optimizer step)."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    # An optimizer that has not stepped yet is sent as none: get_optimizer_state_dict would create its state with a
    # zero-gradient step, which counts as a step for Adam's bias correction.
    stepped = any(opt.state for opt in run.optimizers)
    for part, opt in zip(run.model_parts, run.optimizers):
        model.update({k: _local(v) for k, v in get_model_state_dict(part).items()})
        if stepped:
            optim.update({k: _local(v) for k, v in
                          get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS).items()})
    state: dict[str, Any] = {"model": model, "optimizer": optim if stepped else None,
                             "train_state": {"step": int(run.train_state.step),
                                             "tokens_seen": int(run.train_state.tokens_seen)}}
    if run.lr_scheduler is not None:
        state["lr_scheduler"] = {k: v for k, v in run.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
    if run.dataloader is not None:
        state["dataloader"] = run.dataloader.state_dict()
    state["extra"] = {name: copy.deepcopy(obj.state_dict()) for name, obj in run.extra.items()}
    return state


def _param_name(optim_key: str) -> str:
    """'state.layers.0.wq.weight.exp_avg' -> 'layers.0.wq.weight'."""
    return optim_key.split(".", 1)[1].rsplit(".", 1)[0]


def load_live_state(run: RunState, state: dict[str, Any]) -> None:
    """Put a peer's live_state() into this rank's objects: weights, optimizer, schedule, step, data position."""
    for part, opt in zip(run.model_parts, run.optimizers):
        templates = get_model_state_dict(part)
        set_model_state_dict(part, {k: _like(v, templates[k]) for k, v in state["model"].items() if k in templates})
        if state["optimizer"] is None:
            opt.state.clear()
            continue
        optim = {}
        for key, value in state["optimizer"].items():
            if _param_name(key) not in templates:
                continue
            template = templates[_param_name(key)]
            shard = isinstance(value, torch.Tensor) and isinstance(template, DTensor) \
                and value.shape == template.to_local().shape
            optim[key] = _like(value, template) if shard else value
        set_optimizer_state_dict(part, opt, optim, options=_OPTIM_OPTIONS)
    if run.lr_scheduler is not None and "lr_scheduler" in state:
        sched = dict(state["lr_scheduler"])
        if hasattr(run.lr_scheduler, "lr_lambdas"):
            sched.setdefault("lr_lambdas", [None] * len(run.lr_scheduler.lr_lambdas))
        run.lr_scheduler.load_state_dict(sched)
    run.train_state.step = state["train_state"]["step"]
    run.train_state.tokens_seen = state["train_state"]["tokens_seen"]
    if run.dataloader is not None and state.get("dataloader") is not None:
        run.dataloader.load_state_dict(state["dataloader"], allow_reshard=True)
    for name, obj in run.extra.items():
        if name in state["extra"]:
            obj.load_state_dict(state["extra"][name])

"""What a checkpoint holds of a run, gathered from the live objects and put back into them.

The global part goes into DCP: the model and optimizer in their canonical, layout-independent form (get_state_dict:
FQN keys, full shapes, whatever FSDP/TP sharding produced them), the lr schedule, step and tokens seen, and further
Stateful objects (e.g. a loss scaler). Each rank's part, its data-loader position and RNG states, goes into
ranks/rank-R.pt (rank_state.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_npu.checkpoint.rank_state import capture_rng
from titan_npu.errors import CheckpointError

# Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") is keyed by parameter name only, so
# it merges across pipeline stages and loads under any layout.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class RunState:
    """The objects of a run that a checkpoint saves and restores.

    train_state is any object with integer attributes `step` and `tokens_seen` (the Trainer); `extra` names further
    global Stateful objects.
    """

    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    lr_scheduler: Stateful | None
    dataloader: Stateful | None
    train_state: Any
    extra: dict[str, Stateful] = field(default_factory=dict)
    dp_rank: int = 0
    dp_degree: int = 1
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if len(self.optimizers) not in (1, len(self.model_parts)) or (
            len(self.optimizers) == 1 and len(self.model_parts) > 1
        ):
            raise CheckpointError(
                f"{len(self.model_parts)} model parts with {len(self.optimizers)} optimizers: checkpointing needs "
                "one optimizer per model part"
            )

    def state_dict(self, for_load: bool, sections: tuple[str, ...] | None = None) -> dict[str, Any]:
        """The DCP state of the run (sections=("model",) or ("model", "optimizer"): only those).

        for_load=False hands out copies of the plain values: an async writer reads them after the run moved on.
        """
        model: dict[str, Any] = {}
        for part in self.model_parts:
            model.update(get_model_state_dict(part))
        state: dict[str, Any] = {"model": model}
        if sections is not None and "optimizer" not in sections:
            return state
        optim: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
        state["optimizer"] = optim
        if sections is not None:
            return state
        if self.lr_scheduler is not None:
            sched = self.lr_scheduler.state_dict()
            # lambdas are not data; LambdaLR keeps None in their place and restores the rest.
            state["lr_scheduler"] = {k: v for k, v in sched.items() if k != "lr_lambdas"}
        state["train_state"] = {"step": int(self.train_state.step), "tokens_seen": int(self.train_state.tokens_seen)}
        for name, obj in self.extra.items():
            state[name] = obj.state_dict()
        if not for_load:
            state = {k: (v if k in ("model", "optimizer") else copy.deepcopy(v)) for k, v in state.items()}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Put a state from state_dict(for_load=True), filled by DCP, into the live objects (train_state aside)."""
        model_sd = state["model"]
        for part in self.model_parts:
            own = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in own})
        if "optimizer" in state:
            for part, opt in zip(self.model_parts, self.optimizers):
                set_optimizer_state_dict(part, opt, state["optimizer"], options=_OPTIM_OPTIONS)
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            sched = dict(state["lr_scheduler"])
            if hasattr(self.lr_scheduler, "lr_lambdas"):
                sched.setdefault("lr_lambdas", [None] * len(self.lr_scheduler.lr_lambdas))
            self.lr_scheduler.load_state_dict(sched)
        for name, obj in self.extra.items():
            if name in state:
                obj.load_state_dict(state[name])

    def rank_state(self, rank: int) -> dict[str, Any]:
        """This rank's part: its data-parallel coordinates, data-loader position and RNG states."""
        return {
            "rank": rank, "dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
            "dataloader": self.dataloader.state_dict() if self.dataloader is not None else None,
            "rng": capture_rng(self.device_type),
        }

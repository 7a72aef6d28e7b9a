"""The optimizer (AdamW with the fastest implementation the device has, or Muon beside it) and the learning-rate
schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatch
from functools import partial

import torch
from torch import nn

from titan_npu.config.schema import LRSchedulerConfig, OptimizerConfig
from titan_npu.errors import ConfigError


def param_groups(model_parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings, none on norms (1-D parameters)."""
    return _decay_groups([p for part in model_parts for p in part.parameters() if p.requires_grad], weight_decay)


def _decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def muon_param_groups(model_parts: list[nn.Module], cfg: OptimizerConfig) -> list[dict]:
    """Muon on the matrices (and stacked experts) whose names no muon_exclude pattern matches; AdamW on the rest,
    grouped as param_groups does."""
    muon, rest = [], []
    for part in model_parts:
        for name, p in part.named_parameters():
            if p.requires_grad:
                (muon if takes_muon(clean_name(name), p.ndim, cfg.muon_exclude) else rest).append(p)
    groups = [{"params": muon, "weight_decay": cfg.weight_decay, "muon": True}] if muon else []
    return groups + [g for g in _decay_groups(rest, cfg.weight_decay) if g["params"]]


def takes_muon(name: str, ndim: int, exclude: Sequence[str]) -> bool:
    """Whether Muon optimises the parameter `name`: a matrix (or a stack of them) that no exclude pattern matches."""
    return ndim >= 2 and not any(fnmatch(name, pattern) for pattern in exclude)


def clean_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (activation checkpointing, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


# Devices with torch's fused Adam/AdamW kernel (_fused_adamw_): on npu it is registered by torch_npu's op-plugin.
# torch_npu.optim's NpuFused* optimizers are not used: they refuse zero_grad(set_to_none=True), which the trainer
# and distributed checkpointing call, and bf16 parameters.
FUSED_DEVICES = ("cuda", "cpu", "xpu", "npu")


def _implementation_kwargs(implementation: str, device_type: str) -> dict:
    if implementation == "auto":
        implementation = "fused" if device_type in FUSED_DEVICES else "foreach"
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for-loop":
        return {"foreach": False}
    raise ConfigError(
        f"optimizer.implementation={implementation!r} is unknown (choose auto, fused, foreach or for-loop)"
    )


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD / Muon (AdamW beside it) over all trainable parameters of the model parts."""
    name = cfg.name.lower()
    if name == "sgd":
        return torch.optim.SGD(param_groups(model_parts, cfg.weight_decay), lr=cfg.lr, momentum=cfg.betas[0])
    if name == "muon":
        from titan_npu.trainer.muon import Muon

        groups = muon_param_groups(model_parts, cfg)
        cls = partial(Muon, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                      ns_coefficients=tuple(cfg.muon_ns_coefficients), ns_steps=cfg.muon_ns_steps,
                      ns_dtype=cfg.muon_ns_dtype, adjust_lr=cfg.muon_adjust_lr)
    elif name in ("adamw", "adam"):
        groups = param_groups(model_parts, cfg.weight_decay)
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        if cfg.state_dtype != "fp32":  # torch's Adam on fp32 copies of bf16 moments (trainer/state_dtype.py)
            from titan_npu.trainer.state_dtype import StateDtypeAdam

            cls = partial(StateDtypeAdam, decoupled_weight_decay=name == "adamw")
    else:
        raise ConfigError(f"optimizer.name={cfg.name!r} is unknown (choose AdamW, Adam, SGD or Muon)")
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if name != "sgd" and cfg.state_dtype != "fp32":
        from titan_npu.trainer.state_dtype import STATE_DTYPES

        kwargs["state_dtype"] = STATE_DTYPES[cfg.state_dtype]
    kwargs.update(_implementation_kwargs(cfg.implementation, device_type))
    try:
        return cls(groups, **kwargs)
    except RuntimeError:
        if cfg.implementation != "auto":
            raise
        kwargs.pop("fused", None)
        return cls(groups, **{**kwargs, "foreach": True})


def lr_lambda(step: int, cfg: LRSchedulerConfig, max_steps: int) -> float:
    """Multiplier of the peak lr after `step` optimizer steps: linear warm-up, then the chosen decay."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_type == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.decay_type == "wsd":
        decay_steps = max(1, int(round(cfg.decay_ratio * max_steps)))
        stable_end = max_steps - decay_steps
        if step < stable_end:
            return 1.0
        progress = min(1.0, (step - stable_end) / decay_steps)
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if cfg.decay_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, max_steps: int):
    """A LambdaLR following lr_lambda (its state_dict holds the step, so resume continues the curve)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_lambda(step, cfg, max_steps))

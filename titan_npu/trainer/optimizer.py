"""The optimizer (AdamW with the fastest implementation the device has) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from titan_npu.config.schema import LRSchedulerConfig, OptimizerConfig
from titan_npu.errors import ConfigError


def param_groups(model_parts: list[nn.Module], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings, none on norms (1-D parameters)."""
    decay, no_decay = [], []
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


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
    """AdamW / Adam / SGD over all trainable parameters of the model parts."""
    name = cfg.name.lower()
    groups = param_groups(model_parts, cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.betas[0])
    if name not in ("adamw", "adam"):
        raise ConfigError(f"optimizer.name={cfg.name!r} is unknown (choose AdamW, Adam or SGD)")
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
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

"""Put adapters on the model's linears that [lora] target_modules names, and freeze everything else.

Runs on the whole model on the meta device, before the pipeline split and any parallelism (which then shard the
adapters with their linears). A pattern is an fnmatch pattern (`*`, `?`, `[seq]`) matched against a module's whole
name (`layers.*.attention.wq`) or its last component (`wq`), as peft matches target_modules by suffix.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

from torch import nn

from titan_npu.errors import ConfigError
from titan_npu.lora.linear import add_adapter
from titan_npu.lora.names import scaling

# Linears whose weight the model reads without calling them (the routers' gates, the output projection that the
# chunked loss multiplies by itself): an adapter on them would never run.
_UNWRAPPABLE = ("router", "output", "tok_embeddings")


def matches(name: str, pattern: str) -> bool:
    """Whether `pattern` names the module `name`: its whole name or its last component."""
    return fnmatchcase(name, pattern) or fnmatchcase(name.rsplit(".", 1)[-1], pattern)


def eligible_name(name: str) -> bool:
    """Whether a linear of this name may take an adapter (not a router's gate, the output or the embedding)."""
    return not any(part in _UNWRAPPABLE for part in name.split("."))


def target_names(model: nn.Module, patterns: list[str], defaults: list[str]) -> list[str]:
    """The names of the modules `patterns` select, refusing (ConfigError) a module that cannot take an adapter and a
    pattern of the user's that selects nothing (a default that this family lacks, such as MLA's wq_a, is skipped)."""
    chosen: list[str] = []
    used = set()
    for name, module in model.named_modules():
        hits = [p for p in patterns if name and matches(name, p)]
        if not hits:
            continue
        used.update(hits)
        if not isinstance(module, nn.Linear) or not eligible_name(name):
            what = ("a linear whose weight the model reads directly (router gate, output projection)"
                    if isinstance(module, nn.Linear) else "not a linear layer")
            raise ConfigError(f"lora.target_modules pattern {hits[0]!r} matches {name} ({type(module).__name__}), "
                              f"{what}, which takes no adapter; name attention / MLP projections such as wq or w1")
        chosen.append(name)
    unused = [p for p in patterns if p not in used]
    if not chosen or (unused and list(patterns) != list(defaults)):
        missing = unused or list(patterns)
        sample = ", ".join(n for n, m in model.named_modules() if isinstance(m, nn.Linear))[:160]
        raise ConfigError(f"lora.target_modules pattern(s) {missing} match no module of this model; patterns match a "
                          f"module's name or its last part, e.g. {sample}...")
    return chosen


def apply_lora(model: nn.Module, cfg: Any, defaults: list[str]) -> list[str]:
    """Freeze every parameter of `model` and add a trainable adapter ([lora] `cfg`) to each targeted linear;
    returns their names."""
    names = target_names(model, list(cfg.target_modules), defaults)
    for param in model.parameters():
        param.requires_grad_(False)
    factor = scaling(cfg.rank, cfg.alpha, cfg.use_rslora)
    for name in names:
        add_adapter(model.get_submodule(name), cfg.rank, factor, cfg.dropout)
    return names


def lora_adapter(cfg: Any) -> Callable[[nn.Module], list[str]] | None:
    """apply_lora with [lora] `cfg` (its default targets the schema's), for the model builder; None when LoRA is off."""
    if not cfg.enable:
        return None
    from titan_npu.config.schema import LORA_DEFAULT_TARGETS

    return partial(apply_lora, cfg=cfg, defaults=LORA_DEFAULT_TARGETS)

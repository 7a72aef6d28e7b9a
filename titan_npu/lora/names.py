"""How adapter parameters are named (torch-free): `<module>.lora_A` [r, in] and `<module>.lora_B` [out, r], beside the
frozen `<module>.weight` whose name they leave unchanged."""

from __future__ import annotations

from typing import Any

ADAPTER_NAMES = ("lora_A", "lora_B")


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or state-dict key is an adapter's ('layers.0.attention.wq.lora_A')."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def adapter_module(name: str) -> str:
    """The adapted module of an adapter key ('layers.0.attention.wq.lora_A' -> 'layers.0.attention.wq')."""
    return name.rsplit(".", 1)[0]


def scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """The factor of B A in the update: alpha / r, or alpha / sqrt(r) (rank-stabilised), as peft computes it."""
    return alpha / rank**0.5 if use_rslora else alpha / rank


def lora_record(cfg: Any) -> dict[str, Any] | None:
    """What a checkpoint records of [lora] (export reads it back): None when LoRA is off."""
    if not cfg.enable:
        return None
    return {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout, "use_rslora": cfg.use_rslora,
            "target_modules": list(cfg.target_modules)}

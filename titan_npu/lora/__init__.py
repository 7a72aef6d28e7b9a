"""Low-rank adapters (LoRA): frozen linears that learn W + (alpha / r) B A, trained and exported as peft adapters."""

from __future__ import annotations

from titan_npu.lora.names import ADAPTER_NAMES, is_adapter_name

__all__ = ["ADAPTER_NAMES", "is_adapter_name"]

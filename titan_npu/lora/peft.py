"""Adapters in peft's format: `adapter_model.safetensors` keys and layouts, and `adapter_config.json`.

peft names an adapter by the Hugging Face module it adapts (`base_model.model.<module>.lora_A.weight`, [r, in],
and `lora_B.weight`, [out, r]). A family's Hugging Face mapping renames each of our weights and may permute its
rows or columns (the q/k heads' RoPE layout); the adapters follow: B takes W's row order and A its column order,
so that the Hugging Face B A equals the mapped (B A). A mapping that does more than rename and permute one tensor
(fused or split tensors) has no LoRA counterpart in peft and is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.lora.names import adapter_module, is_adapter_name, scaling

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def _one_tensor(adapter: Any, key: str, tensor: torch.Tensor, args: Any) -> tuple[str, torch.Tensor]:
    """The family's Hugging Face (name, tensor) of our `key` holding `tensor`; CheckpointError unless it is one
    tensor of the same shape."""
    try:
        hf = adapter.to_hf({key: tensor}, args)
    except Exception as e:  # noqa: BLE001 - any failure means the mapping needs more than this one tensor
        raise CheckpointError(f"{key}: the Hugging Face mapping of this family does not convert it alone ({e}); "
                              "its adapter cannot be written for peft: export with --format hf --merge") from None
    if len(hf) != 1 or next(iter(hf.values())).shape != tensor.shape:
        raise CheckpointError(f"{key}: the Hugging Face mapping of this family fuses or splits it ({sorted(hf)}); "
                              "its adapter has no peft counterpart: export with --format hf --merge")
    return next(iter(hf.items()))


def permutations(adapter: Any, key: str, shape: tuple[int, int], args: Any) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(Hugging Face name, row order, column order) of our weight `key` of `shape`: its HF tensor is
    ours[rows][:, cols]; CheckpointError when the mapping is not such a permutation."""
    out, inp = shape
    rows = torch.arange(out, dtype=torch.float64)[:, None].expand(out, inp).contiguous()
    cols = torch.arange(inp, dtype=torch.float64)[None, :].expand(out, inp).contiguous()
    name, hf_rows = _one_tensor(adapter, key, rows, args)
    _, hf_cols = _one_tensor(adapter, key, cols, args)
    row_order, col_order = hf_rows[:, 0].long(), hf_cols[0, :].long()
    probe = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    is_permutation = (torch.equal(row_order.sort().values, torch.arange(out))
                      and torch.equal(col_order.sort().values, torch.arange(inp))
                      and torch.equal(_one_tensor(adapter, key, probe, args)[1], probe[row_order][:, col_order]))
    if not is_permutation:
        raise CheckpointError(f"{key}: the Hugging Face mapping of this family changes its values, not only their "
                              "order; its adapter has no peft counterpart: export with --format hf --merge")
    return name, row_order, col_order


def peft_tensors(adapter: Any, args: Any, module: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """peft's two tensors of the adapter (A [r, in], B [out, r], ours) on our module `module`."""
    hf_weight, rows, cols = permutations(adapter, f"{module}.weight", (b.shape[0], a.shape[1]), args)
    prefix = "base_model.model." + hf_weight.removesuffix(".weight")
    return {f"{prefix}.lora_A.weight": a[:, cols].contiguous(), f"{prefix}.lora_B.weight": b[rows].contiguous()}


# Hugging Face's MLP projection names, which peft (0.21, with transformers 5's weight conversions) takes for the fused
# tensors of a MoE model's routed experts: adapters on a MoE model's dense or shared-expert MLP never reach them.
_MOE_RETARGETED = ("gate_proj", "up_proj", "down_proj")


def refuse_moe_mlp_adapters(hf_modules: list[str], is_moe: bool) -> None:
    """CheckpointError when a MoE model's adapters sit on MLP projections that peft would load elsewhere."""
    mlp = [m for m in hf_modules if m.rsplit(".", 1)[-1] in _MOE_RETARGETED]
    if is_moe and mlp:
        raise CheckpointError(f"--format peft: adapters on the MLP of a MoE model ({mlp[0]} and {len(mlp) - 1} more) "
                              "do not load in peft, which takes gate_proj / up_proj / down_proj of a MoE model for "
                              "its routed experts; export with --format hf --merge, or train with lora."
                              "target_modules on the attention projections")


def adapter_config(lora: dict[str, Any], hf_modules: list[str]) -> dict[str, Any]:
    """adapter_config.json of peft's LoraConfig for these adapters (`lora`: the checkpoint's record of [lora];
    hf_modules: the Hugging Face modules adapted, listed whole so peft adapts exactly those)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "use_rslora": lora["use_rslora"],
        "target_modules": sorted(hf_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
    }


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: dict[str, Any]) -> torch.Tensor:
    """W + scaling B A, in fp32 (the caller casts)."""
    factor = scaling(lora["rank"], lora["alpha"], lora["use_rslora"])
    return weight.float() + factor * (b.float() @ a.float())


def merge_adapters(state: dict[str, torch.Tensor], lora: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict with adapters as one without: each adapted weight merged (in its own dtype), the adapters
    dropped; what generate, eval and initial_load read of a LoRA run's checkpoint."""
    out = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for key in [k for k in state if k.endswith(".lora_A")]:
        module = adapter_module(key)
        weight = out[f"{module}.weight"]
        out[f"{module}.weight"] = merged(weight, state[key], state[f"{module}.lora_B"], lora).to(weight.dtype)
    return out

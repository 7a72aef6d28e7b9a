"""float8 training through torchao: which linears convert, the device gate, the conversion itself and the FSDP2
scale precompute after each optimizer step.

torchao's Float8Linear is an nn.Linear whose weight stays in the training dtype (fp32 master under mixed
precision): each matmul casts its operands to float8 with dynamic scales (tensorwise: one scale per tensor;
rowwise: one per row) and runs torch._scaled_mm. Parameter names and values are those of the plain model, so
checkpoints, resume in either precision and HF export are unchanged. Conversion happens on the meta-device model
before any parallelism (parallel/parallelize.py: parallelize_part); tensor parallelism then applies torchao's float8
styles for the tensorwise recipe (float8 all-gathers of the activations) and the plain ones for rowwise. Over gloo,
which carries no float8, every all-gather stays in high precision.

The rule of which linears convert (`converts`) is torch-free so the planner sizes the same set.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_npu.errors import ConfigError

if TYPE_CHECKING:
    from titan_npu.config.schema import Float8Config

TORCHAO_VERSION = "0.18.0"
INSTALL_HINT = f"pip install 'titan-npu[float8]' (or pip install torchao=={TORCHAO_VERSION})"
CUDA_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: the first GPUs with float8 tensor cores
FLOAT8_ALIGNMENT = 16  # torch._scaled_mm needs both dims of the weight to be multiples of 16


def converts(fqn: str, out_features: int, in_features: int, cfg: Float8Config) -> bool:
    """Whether the linear `fqn` with a weight [out_features, in_features] runs in float8 under `cfg`.

    Skipped: names containing one of cfg.filter_fqns; dims not multiples of 16; with cfg.auto_filter_small_kn,
    shapes too small to gain on H100-class parts (the thresholds of torchao's _auto_filter_for_recipe, per recipe).
    """
    if any(name in fqn for name in cfg.filter_fqns):
        return False
    n, k = out_features, in_features
    if n % FLOAT8_ALIGNMENT or k % FLOAT8_ALIGNMENT:
        return False
    if not cfg.auto_filter_small_kn:
        return True
    if cfg.recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def float8_collectives() -> bool:
    """Whether the process group carries float8 tensors: gloo does not (its collectives refuse the dtype), so a
    gloo run all-gathers weights and activations in high precision; NCCL and HCCL carry them."""
    import torch.distributed as dist

    return dist.is_initialized() and "gloo" not in dist.get_backend()


def wants_float8_all_gather(cfg: Float8Config) -> bool:
    """Whether the config asks FSDP2 to all-gather the converted weights in float8: tensorwise only (torchao's
    rule), float8.fsdp_float8_all_gather."""
    return cfg.enable and cfg.recipe == "tensorwise" and cfg.fsdp_float8_all_gather


def uses_float8_all_gather(cfg: Float8Config, dp_mode: str) -> bool:
    """Whether FSDP2 (dp_mode fsdp or hsdp, ParallelDims.dp_mode) does all-gather in float8 here: as asked, over a
    backend that carries float8."""
    return wants_float8_all_gather(cfg) and dp_mode in ("fsdp", "hsdp") and float8_collectives()


def import_torchao() -> Any:
    """torchao.float8, or a one-line ConfigError naming the install command."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as e:
        raise ConfigError(f"float8.enable = true needs torchao, which is not installed ({e}); {INSTALL_HINT}") from e


def _npu_has_scaled_mm() -> bool:
    """Whether the loaded torch_npu registers torch._scaled_mm (torchao's float8 matmul) for the NPU."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", "PrivateUse1")


def check_float8_device(cfg: Float8Config, device_type: str, capability: tuple[int, int] | None = None,
                        device_name: str = "") -> None:
    """ConfigError in one line unless this device runs float8 matmuls (emulation runs anywhere).

    CUDA needs compute capability 8.9 or later; an NPU needs a torch_npu that registers torch._scaled_mm; a CPU
    only emulates (float8.emulate = true: float8 casts, high-precision matmuls)."""
    if not cfg.enable or cfg.emulate:
        return
    where = f"{device_type} ({device_name})" if device_name else device_type
    if device_type == "cuda":
        if capability is not None and tuple(capability) >= CUDA_MIN_CAPABILITY:
            return
        found = "" if capability is None else f", this one is sm{capability[0]}{capability[1]}"
        missing = f"float8 tensor cores (CUDA sm89 or later{found})"
    elif device_type == "npu":
        if _npu_has_scaled_mm():
            return
        missing = "a float8 matmul (this torch_npu registers no torch._scaled_mm for the NPU)"
    else:
        missing = "float8 matmul units"
    raise ConfigError(f"float8.enable = true: {where} lacks {missing}; run on such a device, set float8.emulate = "
                      f"true to test the numerics (not faster), or set float8.enable = false")


def float8_linear_config(cfg: Float8Config, dp_mode: str) -> Any:
    """torchao's Float8LinearConfig for cfg's recipe, with emulation and FSDP2 float8 all-gather as asked."""
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    return dataclasses.replace(config, emulate=cfg.emulate,
                               enable_fsdp_float8_all_gather=uses_float8_all_gather(cfg, dp_mode))


def convert_to_float8(model: nn.Module, cfg: Float8Config, dp_mode: str) -> list[str]:
    """Swap the linears `converts` picks for torchao's Float8Linear, in place (on meta before parallelism too);
    the names of those converted."""
    if not cfg.enable:
        return []
    float8 = import_torchao()
    chosen = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
              and type(m).__name__ != "Float8Linear" and converts(name, m.out_features, m.in_features, cfg)]
    selected = set(chosen)
    float8.convert_to_float8_training(model, config=float8_linear_config(cfg, dp_mode),
                                      module_filter_fn=lambda _, fqn: fqn in selected)
    return chosen


def _is_tensorwise_float8(module: nn.Module) -> bool:
    if type(module).__name__ != "Float8Linear":
        return False
    return module.config.cast_config_input.scaling_granularity.value == "tensorwise"


def float8_plan(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """A tensor-parallel plan for `module` with each column- or row-wise linear that is a tensorwise Float8Linear
    given torchao's float8 style (its activations cast to float8 before the all-gather, its gradient cast on the
    way back); rowwise and high-precision linears, and every linear over gloo, keep the plain styles, which serve
    them unchanged."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = dict(plan)
    if not float8_collectives():
        return out
    for fqn, style in plan.items():
        plain = type(style) in (ColwiseParallel, RowwiseParallel)
        if not plain or not _is_tensorwise_float8(module.get_submodule(fqn)):
            continue
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
        out[fqn] = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                       use_local_output=style.use_local_output)
    return out


def describe_float8(cfg: Float8Config, parts: list[nn.Module]) -> str:
    """A log line: the recipe, and how many of the model's linears run in float8."""
    linears = [m for part in parts for m in part.modules() if isinstance(m, nn.Linear)]
    converted = sum(type(m).__name__ == "Float8Linear" for m in linears)
    mode = " (emulated: float8 casts, high-precision matmuls)" if cfg.emulate else ""
    return (f"float8: {cfg.recipe}{mode}, {converted} of {len(linears)} linears converted (skipped: names with "
            f"{', '.join(cfg.filter_fqns) or 'none'}, dims not multiples of 16"
            f"{', small shapes' if cfg.auto_filter_small_kn else ''})")


def precompute_float8_scales(parts: list[nn.Module]) -> None:
    """After the optimizer step: every float8-all-gathered weight's scale in one all-reduce (torchao's
    precompute_float8_dynamic_scale_for_fsdp), so the next forward's all-gathers need none; a no-op elsewhere."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)

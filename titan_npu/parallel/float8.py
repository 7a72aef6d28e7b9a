"""float8 training through torchao: which linears convert, the device gate, the conversion itself and the FSDP2
scale precompute after each optimizer step.

torchao's Float8Linear is an nn.Linear whose weight stays in the training dtype (fp32 master under mixed
precision): each matmul casts its operands to float8 with dynamic scales (tensorwise: one scale per tensor;
rowwise: one per row) and runs torch._scaled_mm. Parameter names and values are those of the plain model, so
checkpoints, resume in either precision and HF export are unchanged. Conversion happens on the meta-device model
before any parallelism (parallel/parallelize.py: parallelize_part); tensor parallelism then applies torchao's float8
styles for the tensorwise recipe (float8 all-gathers of the activations) and the plain ones for rowwise. Over gloo,
which carries no float8, every all-gather stays in high precision.

The MoE routed experts (float8.moe_experts) keep their stacked weights [n_experts, out, in] as they are too: the
conversion hands each GroupedExperts a grouped GEMM (`float8_grouped_mm`) that runs torchao's prototype
dynamically-quantised grouped GEMM (torchao.prototype.moe_training: float8 rowwise with torch._scaled_grouped_mm on
CUDA sm90+, MXFP8 on sm100+, MXFP8 emulated on any device) in place of the high-precision one, each expert's rows
padded with zeros to the recipe's block.

The rules of which linears and experts convert (`converts`, `converts_experts`) are torch-free so the planner sizes
the same set.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable
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
# The MoE grouped GEMMs' block per recipe: both dims of each expert's weight and each expert's rows (tokens) a multiple
# of it. rowwise: torch._scaled_grouped_mm's 16-byte float8 rows; mxfp8: one scale per 32 values along every
# contraction, the tokens' in the weight gradient included.
MOE_BLOCK = {"rowwise": 16, "mxfp8": 32}
# The first GPUs with each recipe's grouped GEMM kernels: Hopper (torch._scaled_grouped_mm), Blackwell (MXFP8).
MOE_CUDA_MIN_CAPABILITY = {"rowwise": (9, 0), "mxfp8": (10, 0)}


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


def converts_experts(fqn: str, dim: int, ffn_dim: int, cfg: Float8Config) -> bool:
    """Whether the routed experts `fqn` (w1, w3 [n_experts, ffn_dim, dim], w2 [n_experts, dim, ffn_dim]) run their
    grouped GEMMs in float8 under `cfg`: float8.enable and float8.moe_experts, a name without any of cfg.filter_fqns,
    both dims multiples of the recipe's block (MOE_BLOCK). No size rule: the experts are the largest GEMMs of a MoE
    model."""
    if not (cfg.enable and cfg.moe_experts) or any(name in fqn for name in cfg.filter_fqns):
        return False
    block = MOE_BLOCK[cfg.moe_recipe]
    return dim % block == 0 and ffn_dim % block == 0


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


def npu_has_float8_units(device_name: str) -> bool:
    """Whether the Ascend part `device_name` (torch.npu.get_device_name: "Ascend910B3", "Ascend950PR", ...) has float8
    matmul units: the 950 family only (torch_npu's API reference gives float8_e4m3fn to "Ascend 950PR/Ascend 950DT"
    alone; its meta registrations name SocVersion::Ascend950 the first such SoC). The 910B / 910C parts have none."""
    return re.fullmatch(r"ascend\s*950\w*", device_name.strip().lower()) is not None


def _npu_has_grouped_mm() -> bool:
    """Whether the loaded torch_npu registers torch._grouped_mm (what torchao's MXFP8 emulation calls) for the NPU."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", "PrivateUse1")


def _mxfp8_kernels_available() -> bool:
    """Whether this torchao build carries its SM100 MXFP8 grouped GEMM kernels (CUDA extension and Triton)."""
    return importlib.import_module("torchao.prototype.moe_training.mxfp8_grouped_mm")._SM100_KERNELS_AVAILABLE


def check_float8_device(cfg: Float8Config, device_type: str, capability: tuple[int, int] | None = None,
                        device_name: str = "") -> None:
    """ConfigError in one line unless this device runs float8 matmuls (emulation runs anywhere).

    CUDA needs compute capability 8.9 or later; an NPU needs an Ascend 950 part and a torch_npu that registers
    torch._scaled_mm; a CPU only emulates (float8.emulate = true: float8 casts, high-precision matmuls). The MoE
    experts' grouped GEMMs (float8.moe_experts) have their own gate, _check_moe_device."""
    if not cfg.enable:
        return
    where = f"{device_type} ({device_name})" if device_name else device_type
    if cfg.moe_experts:
        _check_moe_device(cfg, device_type, capability, where)
    if cfg.emulate:
        return
    if device_type == "cuda":
        if capability is not None and tuple(capability) >= CUDA_MIN_CAPABILITY:
            return
        found = "" if capability is None else f", this one is sm{capability[0]}{capability[1]}"
        missing = f"float8 tensor cores (CUDA sm89 or later{found})"
    elif device_type == "npu":
        if not _npu_has_scaled_mm():
            missing = "a float8 matmul (this torch_npu registers no torch._scaled_mm for the NPU)"
        elif not npu_has_float8_units(device_name):
            missing = "float8 matmul units (an Ascend 950 part has them; 910B and 910C parts do not)"
        else:
            return
    else:
        missing = "float8 matmul units"
    raise ConfigError(f"float8.enable = true: {where} lacks {missing}; run on such a device, set float8.emulate = "
                      f"true to test the numerics (not faster), or set float8.enable = false")


def _check_moe_device(cfg: Float8Config, device_type: str, capability: tuple[int, int] | None, where: str) -> None:
    """ConfigError in one line unless this device runs torchao's grouped GEMM of float8.moe_recipe (emulated: MXFP8's
    dequantise-and-torch._grouped_mm, any device with torch._grouped_mm; rowwise has no emulation, validate.py)."""
    recipe = f"float8.moe_experts = true ({cfg.moe_recipe})"
    if cfg.emulate:
        if device_type != "npu" or _npu_has_grouped_mm():
            return
        raise ConfigError(f"{recipe}, emulated: {where} lacks torch._grouped_mm (this torch_npu registers none for the "
                          f"NPU; torchao's emulation dequantises and calls it); set float8.moe_experts = false")
    if device_type == "cuda":
        need = MOE_CUDA_MIN_CAPABILITY[cfg.moe_recipe]
        sm = f"sm{need[0]}{need[1]}"
        if capability is None or tuple(capability) < need:
            found = "" if capability is None else f", this one is sm{capability[0]}{capability[1]}"
            missing = f"the {cfg.moe_recipe} grouped GEMM kernels (CUDA {sm} or later{found})"
        elif cfg.moe_recipe == "rowwise" and not hasattr(torch, "_scaled_grouped_mm"):
            missing = "torch._scaled_grouped_mm (this torch build has none)"
        elif cfg.moe_recipe == "mxfp8" and not _mxfp8_kernels_available():
            missing = f"torchao's MXFP8 kernels (this torchao build has no {sm} extension)"
        else:
            return
    elif device_type == "npu":
        missing = ("torchao's float8 grouped GEMM (it quantises with CUDA Triton kernels, and this torch_npu registers "
                   "no torch._grouped_mm for its emulation either)" if not _npu_has_grouped_mm() else
                   "torchao's float8 grouped GEMM (it quantises with CUDA Triton kernels)")
    else:
        missing = "float8 grouped GEMM units"
    alternative = "float8.moe_recipe = 'mxfp8' and float8.emulate = true to test the numerics (not faster)"
    raise ConfigError(f"{recipe}: {where} lacks {missing}; run on such a GPU, set {alternative}, or set "
                      f"float8.moe_experts = false (the other linears still convert)")


def float8_linear_config(cfg: Float8Config, dp_mode: str) -> Any:
    """torchao's Float8LinearConfig for cfg's recipe, with emulation and FSDP2 float8 all-gather as asked."""
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    return dataclasses.replace(config, emulate=cfg.emulate,
                               enable_fsdp_float8_all_gather=uses_float8_all_gather(cfg, dp_mode))


def convert_to_float8(model: nn.Module, cfg: Float8Config, dp_mode: str) -> list[str]:
    """Swap the linears `converts` picks for torchao's Float8Linear and give the experts `converts_experts` picks
    torchao's grouped GEMM, in place (on meta before parallelism too); the names of those converted."""
    if not cfg.enable:
        return []
    float8 = import_torchao()
    chosen = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
              and type(m).__name__ != "Float8Linear" and converts(name, m.out_features, m.in_features, cfg)]
    selected = set(chosen)
    float8.convert_to_float8_training(model, config=float8_linear_config(cfg, dp_mode),
                                      module_filter_fn=lambda _, fqn: fqn in selected)
    return chosen + convert_experts_to_float8(model, cfg)


def grouped_mm_config(recipe: str, emulate: bool) -> Any:
    """torchao's op config for float8.moe_recipe: Float8TrainingOpConfig (rowwise) or MXFP8TrainingOpConfig (its
    emulated recipe under float8.emulate). Their output is bf16 (the emulation's torch._grouped_mm runs on the
    dequantised bf16 operands, and its CPU kernel writes only their dtype)."""
    try:
        moe = importlib.import_module("torchao.prototype.moe_training.config")
    except ImportError as e:
        raise ConfigError(f"float8.moe_experts = true needs torchao, which is not installed ({e}); "
                          f"{INSTALL_HINT}") from e
    if recipe == "mxfp8":
        name = "MXFP8_EMULATED_RCEIL" if emulate else "MXFP8_RCEIL"
        config = moe.MXFP8TrainingOpConfig.from_recipe(moe.MXFP8TrainingRecipe[name])
    else:
        config = moe.Float8TrainingOpConfig.from_recipe(moe.Float8TrainingRecipe.FP8_ROWWISE)
    return config


def pad_groups(x: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x's rows with each group's padded with zero rows to a multiple of `block`, [R, K]; the padded groups' int32
    cumulative ends; where each row of x went, [N]) for x [N, K] sorted by group, offsets its int32 cumulative ends.
    R = N + groups x (block - 1) rounded up to the block: a bound known on the host, so nothing is read back; rows
    past the last group are zeros that no group holds."""
    n_rows, groups = x.shape[0], offsets.shape[0]
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = (counts + block - 1) // block * block
    padded_ends = padded_counts.cumsum(0)
    row = torch.arange(n_rows, device=x.device)
    group = torch.searchsorted(ends, row, right=True).clamp_(max=groups - 1)
    dest = row - (ends - counts)[group] + (padded_ends - padded_counts)[group]
    bound = -(-(n_rows + groups * (block - 1)) // block) * block
    padded = x.new_zeros(bound, x.shape[1]).index_copy(0, dest, x)
    return padded, padded_ends.to(torch.int32), dest


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None,
                      *, config: Any, block: int) -> torch.Tensor:
    """ops.grouped_mm's product (x [N, K] sorted by group, w [G, M, K], int32 cumulative ends) through torchao's
    dynamically-quantised grouped GEMM of `config` (grouped_mm_config), forward and backward: each group padded to
    `block` rows (pad_groups), the padding dropped from the output, which is cast back to x's dtype. max_group_rows:
    unused (no kernel here pads to it)."""
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    # A tensor-parallel slice of the ffn dim: converts_experts saw the whole dim.
    if w.shape[1] % block or w.shape[2] % block:
        raise ConfigError(f"float8.moe_experts = true: this rank's experts are {list(w.shape)} but the grouped GEMM "
                          f"needs both matrix dims multiples of {block} (under tensor parallelism moe_ffn_dim / "
                          f"tp_degree); choose such a tp_degree or set float8.moe_experts = false")
    padded, ends, rows = pad_groups(x, offsets, block)
    out = _quantize_then_scaled_grouped_mm(padded, w.transpose(-2, -1), config, offs=ends)
    return out.index_select(0, rows).to(x.dtype)


def experts_grouped_mm(recipe: str, emulate: bool) -> Callable[..., torch.Tensor]:
    """float8_grouped_mm for float8.moe_recipe, its torchao config and block bound. The emulation runs eagerly under
    torch.compile (torch 2.13's Inductor fails to generate CPU code for its MXFP8 casts); it is for the numerics."""
    mm = functools.partial(float8_grouped_mm, config=grouped_mm_config(recipe, emulate), block=MOE_BLOCK[recipe])
    return torch.compiler.disable(mm) if emulate else mm


def convert_experts_to_float8(model: nn.Module, cfg: Float8Config) -> list[str]:
    """Hand each routed-experts module `converts_experts` picks (a module with a `float8_grouped_mm` slot: models/moe/
    experts.py's GroupedExperts) torchao's grouped GEMM; the names of those converted."""
    chosen = []
    for name, m in model.named_modules():
        if not hasattr(m, "float8_grouped_mm") or not converts_experts(name, m.w1.shape[2], m.w1.shape[1], cfg):
            continue
        m.float8_grouped_mm = experts_grouped_mm(cfg.moe_recipe, cfg.emulate)  # torchao missing: refused here
        chosen.append(name)
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
    """A log line: the recipe, how many of the model's linears run in float8, and with float8.moe_experts how many
    of its routed-experts modules."""
    linears = [m for part in parts for m in part.modules() if isinstance(m, nn.Linear)]
    converted = sum(type(m).__name__ == "Float8Linear" for m in linears)
    mode = " (emulated: float8 casts, high-precision matmuls)" if cfg.emulate else ""
    line = (f"float8: {cfg.recipe}{mode}, {converted} of {len(linears)} linears converted (skipped: names with "
            f"{', '.join(cfg.filter_fqns) or 'none'}, dims not multiples of 16"
            f"{', small shapes' if cfg.auto_filter_small_kn else ''})")
    if not cfg.moe_experts:
        return line
    experts = [m for part in parts for m in part.modules() if hasattr(m, "float8_grouped_mm")]
    grouped = sum(m.float8_grouped_mm is not None for m in experts)
    return (f"{line}; MoE experts: {cfg.moe_recipe}{' (emulated)' if cfg.emulate else ''} grouped GEMMs in "
            f"{grouped} of {len(experts)} layers (skipped: dims not multiples of {MOE_BLOCK[cfg.moe_recipe]})")


def precompute_float8_scales(parts: list[nn.Module]) -> None:
    """After the optimizer step: every float8-all-gathered weight's scale in one all-reduce (torchao's
    precompute_float8_dynamic_scale_for_fsdp), so the next forward's all-gathers need none; a no-op elsewhere."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)

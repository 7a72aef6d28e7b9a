"""Peak dense FLOP/s per device, for MFU: a table for accelerators and a short measured matmul peak on cpu."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_npu.atomic import atomic_write_json
from titan_npu.device.detect import DeviceInfo

TFLOPS = 1e12


@dataclass(frozen=True)
class Peak:
    """Dense peak FLOP/s of one device: bf16/fp16 tensor cores, fp32 matmuls on TF32 (or HF32) units, plain fp32,
    float8 tensor cores (0: none)."""

    bf16: float
    tf32: float
    fp32: float
    fp8: float = 0.0


def _npu(bf16_tflops: float) -> Peak:
    # Ascend cubes run fp32 matmuls at half the bf16 rate at best (HF32-class).
    half = bf16_tflops / 2 * TFLOPS
    return Peak(bf16_tflops * TFLOPS, half, half)


def _gpu(bf16_tflops: float, tf32_tflops: float, fp32_tflops: float, fp8_tflops: float = 0.0) -> Peak:
    return Peak(bf16_tflops * TFLOPS, tf32_tflops * TFLOPS, fp32_tflops * TFLOPS, fp8_tflops * TFLOPS)


# Dense peaks (datasheet figures without sparsity; float8 only on parts with float8 tensor cores: Ada, Hopper,
# Blackwell) keyed by the canonical device name (canonical_device_name);
# a name is looked up exactly, so variants with their own figures (H100 NVL / PCIe, L40 / L40S / L4) never borrow
# another's.
PEAKS: dict[str, Peak] = {
    "910b1": _npu(373.9),
    "910b2c": _npu(353.9),
    "910b2": _npu(353.9),
    "910b3": _npu(294.9),
    "910b4": _npu(245.8),
    "910_93": _npu(353.9),  # Atlas A3 (910C die)
    "910b": _npu(294.9),  # unknown 910B SKU: the conservative common figure
    "910a": _npu(256.0),
    "910": _npu(256.0),
    "h200": _gpu(989, 494.5, 67, 1979),
    "h200 nvl": _gpu(835, 417.5, 60, 1671),
    "h100": _gpu(989, 494.5, 67, 1979),
    "h100 pcie": _gpu(756, 378, 51, 1513),
    "h100 nvl": _gpu(835, 417.5, 60, 1671),
    "h800": _gpu(989, 494.5, 67, 1979),
    "h800 pcie": _gpu(756, 378, 51, 1513),
    "h20": _gpu(148, 74, 44, 296),
    "gh200": _gpu(989, 494.5, 67, 1979),
    "b200": _gpu(2250, 1100, 75, 4500),
    "a100": _gpu(312, 156, 19.5),
    "a100 pcie": _gpu(312, 156, 19.5),
    "a800": _gpu(312, 156, 19.5),
    "a800 pcie": _gpu(312, 156, 19.5),
    "l40s": _gpu(362, 183, 91.6, 733),
    "l40": _gpu(181, 90.5, 90.5, 362),
    "l4": _gpu(121, 60, 30.3, 242),
    "a10g": _gpu(70, 35, 31.2),
    "a10": _gpu(125, 62.5, 31.2),
    "v100": _gpu(125, 15.7, 15.7),  # fp16 tensor cores (no bf16, no TF32)
    "4090": _gpu(165, 82.6, 82.6, 330),
    "3090": _gpu(71, 35.6, 35.6),
}

# Words of a device name that say nothing about its peak: vendor and brand words, memory size and type, form factor.
_NOISE = re.compile(r"nvidia|tesla|geforce|rtx|\d+gb|hbm\d*e?|sxm\d*")


def canonical_device_name(device_name: str) -> str:
    """The PEAKS key of a device name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H100 NVL" -> "h100 nvl",
    "NVIDIA A100-SXM4-80GB" -> "a100", "Ascend910B3" -> "910b3", "Ascend910_9392" -> "910_93"."""
    name = device_name.strip().lower()
    ascend = re.fullmatch(r"ascend\s*(910\w*)", name)
    if ascend:
        model = ascend.group(1)
        return "910_93" if model.startswith("910_93") else model
    words = [w for w in re.split(r"[\s\-_]+", name) if w and not _NOISE.fullmatch(w)]
    return " ".join(words)


def lookup_peak(device_name: str) -> Peak | None:
    """The dense peaks of a device from the table, or None if the name is not in it."""
    return PEAKS.get(canonical_device_name(device_name))


def lookup_float8_flops(device_name: str) -> float:
    """Dense float8 peak for a device name from the table; 0 when unknown or without float8 tensor cores."""
    peak = lookup_peak(device_name)
    return peak.fp8 if peak is not None else 0.0


def lookup_peak_flops(device_name: str) -> float | None:
    """bf16 dense peak for a device name from the table, or None if unknown."""
    peak = lookup_peak(device_name)
    return peak.bf16 if peak is not None else None


@functools.lru_cache(maxsize=8)
def measure_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 3) -> float:
    """Best of a few n x n x n torch.mm runs on cpu, in FLOP/s (the peak that MFU on cpu is measured against)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool and kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: DeviceInfo, dtype: torch.dtype = torch.bfloat16, override_tflops: float = 0.0,
               tf32: bool = False) -> float:
    """Peak FLOP/s of one device for `dtype`: config override, else table (accelerators), else measured (cpu).

    fp32 is scored against the TF32 (HF32) peak when tf32 says fp32 matmuls run on those units, else plain fp32.
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cpu":
        from titan_npu.ops.cpu import widen_bf16

        if dtype == torch.bfloat16 and widen_bf16():
            dtype = torch.float32  # the model's bf16 matmuls run on the fp32 units here (titan_npu/ops/cpu.py)
        return cpu_peak_flops(dtype)
    peak = lookup_peak(device.name)
    if peak is None:
        return measure_accelerator_flops(device, dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return peak.bf16
    return peak.tf32 if tf32 else peak.fp32


def measure_accelerator_flops(device: DeviceInfo, dtype: torch.dtype, n: int = 8192) -> float:
    """Measured matmul peak for an accelerator that is not in the table."""
    from titan_npu.device.detect import synchronize

    a = torch.randn(n, n, dtype=dtype, device=device.torch_device)
    b = torch.randn(n, n, dtype=dtype, device=device.torch_device)
    torch.mm(a, b)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    synchronize(device)
    return 5 * 2 * n**3 / (time.perf_counter() - t0)


def _peak_cache_path() -> Path:
    root = os.environ.get("TITAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "titan-npu")
    return Path(root) / "cpu_peak_flops.json"


def _cpu_key(dtype: torch.dtype) -> str:
    import platform

    return f"{platform.processor() or platform.machine()}|threads={torch.get_num_threads()}|{dtype}"


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """The cpu matmul peak: this start's measurement or the best one this machine has recorded, whichever is higher.

    A reading taken while other processes share the cores comes out low and would inflate MFU; remembering the best
    reading per (cpu, threads, dtype) keeps the reference stable across runs.
    """
    measured = measure_matmul_flops(dtype)
    path, key = _peak_cache_path(), _cpu_key(dtype)
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    previous = cache.get(key)
    previous = float(previous) if isinstance(previous, (int, float)) else 0.0
    best = max(measured, previous)
    if best > previous:
        cache[key] = best
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, cache)  # ranks sharing a home each write through their own temporary
        except OSError:
            pass  # a read-only home only loses the memory of the best reading
    return best

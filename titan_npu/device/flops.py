"""Peak dense FLOP/s per device, for MFU: a table for accelerators and a short measured matmul peak on cpu."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import torch

from titan_npu.device.detect import DeviceInfo

# bf16 dense peak FLOP/s by (lower-case) device-name fragment; the first match wins, so specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("910b1", 373.9e12),
    ("910b2c", 353.9e12),
    ("910b2", 353.9e12),
    ("910b3", 294.9e12),
    ("910b4", 245.8e12),
    ("910_93", 353.9e12),  # Atlas A3 (910C die)
    ("910b", 294.9e12),  # unknown 910B SKU: the conservative common figure
    ("910", 256.0e12),
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("h800", 989e12),
    ("h20", 148e12),
    ("gh200", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),
    ("a800", 312e12),
    ("l40s", 362e12),
    ("a10g", 70e12),
    ("a10", 125e12),
    ("l4", 121e12),
    ("v100", 125e12),  # fp16 tensor cores (no bf16)
    ("4090", 165e12),
    ("3090", 71e12),
]


def lookup_peak_flops(device_name: str) -> float | None:
    """bf16 dense peak for a device name from the table, or None if unknown."""
    name = device_name.lower()
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment in name:
            return flops
    return None


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


def peak_flops(device: DeviceInfo, dtype: torch.dtype = torch.bfloat16, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device for `dtype`: config override, else table (accelerators), else measured (cpu)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cpu":
        from titan_npu.ops.cpu import widen_bf16

        if dtype == torch.bfloat16 and widen_bf16():
            dtype = torch.float32  # the model's bf16 matmuls run on the fp32 units here (titan_npu/ops/cpu.py)
        return cpu_peak_flops(dtype)
    flops = lookup_peak_flops(device.name)
    if flops is None:
        return measure_accelerator_flops(device, dtype)
    return flops if dtype in (torch.bfloat16, torch.float16) else flops / 2  # fp32 uses TF32-class rates at best


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
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only loses the memory of the best reading
    return best

"""Memory used / peak / total for the current device; process RSS and machine RAM on cpu."""

from __future__ import annotations

import os
from dataclasses import dataclass

from titan_npu.device.detect import DeviceInfo, device_module

GB = 1024**3


@dataclass(frozen=True)
class MemoryStats:
    used_gb: float  # currently allocated by this process (reserved on accelerators)
    peak_gb: float  # peak since the last reset
    total_gb: float  # device capacity (machine RAM on cpu)


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    current = peak
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return current, peak


def _machine_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def available_bytes(device_type: str, index: int | None = None) -> int | None:
    """Memory this process could still allocate: free device memory on an accelerator, the machine's available
    RAM (MemAvailable) on cpu; None where it cannot be told."""
    mod = device_module(device_type)
    try:
        if mod is None:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return None
        return int(mod.mem_get_info(index if index is not None else mod.current_device())[0])
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None


def memory_stats(device: DeviceInfo) -> MemoryStats:
    """Memory figures for the log line: device memory on npu/cuda/xpu, process RSS on cpu."""
    mod = device_module(device.type)
    if mod is None:
        current, peak = _rss_bytes()
        return MemoryStats(current / GB, peak / GB, _machine_ram_bytes() / GB)
    used = mod.memory_reserved(device.index)
    peak = mod.max_memory_reserved(device.index)
    total = mod.get_device_properties(device.index).total_memory
    return MemoryStats(used / GB, peak / GB, total / GB)


def reset_peak_memory(device: DeviceInfo) -> None:
    """Start a new peak-memory window (accelerators only; RSS peak cannot be reset)."""
    mod = device_module(device.type)
    if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
        mod.reset_peak_memory_stats(device.index)


def empty_cache(device: DeviceInfo) -> None:
    """Return cached blocks to the device (after a checkpoint load, for example)."""
    mod = device_module(device.type)
    if mod is not None and hasattr(mod, "empty_cache"):
        mod.empty_cache()

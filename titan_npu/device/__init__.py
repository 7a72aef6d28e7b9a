"""The device layer: detection, backend, memory, peak FLOPs and vendor environment, all decided at run time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_npu.lazy import lazy_exports

if TYPE_CHECKING:
    from titan_npu.device.detect import (
        BACKENDS,
        DeviceInfo,
        detect_device_type,
        device_module,
        import_torch_npu,
        setup_device,
        synchronize,
    )
    from titan_npu.device.env import apply_communication_env, communication_env
    from titan_npu.device.flops import lookup_peak_flops, measure_matmul_flops, peak_flops
    from titan_npu.device.memory import MemoryStats, empty_cache, memory_stats, reset_peak_memory
    from titan_npu.device.npu import set_memory_fraction

# Loaded on first use: the launcher sets the variables torch_npu reads at import (device/env.py) before torch is
# imported, and torch imports torch_npu through its torch.backends entry point.
_EXPORTS = {
    **dict.fromkeys(("BACKENDS", "DeviceInfo", "detect_device_type", "device_module", "import_torch_npu",
                     "setup_device", "synchronize"), "titan_npu.device.detect"),
    **dict.fromkeys(("apply_communication_env", "communication_env"), "titan_npu.device.env"),
    **dict.fromkeys(("lookup_peak_flops", "measure_matmul_flops", "peak_flops"), "titan_npu.device.flops"),
    **dict.fromkeys(("MemoryStats", "empty_cache", "memory_stats", "reset_peak_memory"), "titan_npu.device.memory"),
    "set_memory_fraction": "titan_npu.device.npu",
}

__all__ = [
    "BACKENDS",
    "DeviceInfo",
    "MemoryStats",
    "apply_communication_env",
    "communication_env",
    "detect_device_type",
    "device_module",
    "empty_cache",
    "import_torch_npu",
    "lookup_peak_flops",
    "measure_matmul_flops",
    "memory_stats",
    "peak_flops",
    "reset_peak_memory",
    "set_memory_fraction",
    "setup_device",
    "synchronize",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)

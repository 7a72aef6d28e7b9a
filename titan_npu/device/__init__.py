"""The device layer: detection, backend, memory, peak FLOPs and vendor environment, all decided at run time."""

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

"""The devices the planner knows: memory, peak FLOPs and the effective bandwidth of the links between them."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from titan_npu.device.flops import lookup_float8_flops, lookup_peak_flops
from titan_npu.errors import ConfigError
from titan_npu.planner.layout import GiB

GB = 1e9
MAX_DEVICE_MEMORY = 16 * 1024 * GiB  # per device: no accelerator comes near it; a larger --device-memory is a typo


@dataclass(frozen=True)
class Hardware:
    """One device kind and the links between devices (bandwidths: effective collective bus bandwidth per device)."""

    name: str
    device_type: str  # npu | cuda | cpu
    memory_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    intra_node_bw: float  # bytes/s
    inter_node_bw: float  # bytes/s
    intra_link: str
    inter_link: str
    host_bw: float = 25 * GB  # to host memory, each way (cpu_offload and activation offload traffic)
    host_link: str = "PCIe 4.0 x16"
    peak_float8_flops: float = 0.0  # dense float8 FLOP/s; 0 = no float8 tensor cores


def _spec(name: str, device_type: str, memory_gib: float, intra_gbs: float, inter_gbs: float, intra: str,
          inter: str, flops_name: str | None = None, host: tuple[float, str] = (25, "PCIe 4.0 x16")) -> Hardware:
    peak = lookup_peak_flops(flops_name or name)
    assert peak is not None, name
    return Hardware(name, device_type, int(memory_gib * GiB), peak, intra_gbs * GB, inter_gbs * GB, intra, inter,
                    peak_float8_flops=lookup_float8_flops(flops_name or name), host_bw=host[0] * GB, host_link=host[1])


# The host link, each way, as pinned-memory copies reach it (about 80% of the line rate): PCIe 4.0 x16 is 32 GB/s a
# way (A100/A800 datasheets: "PCIe Gen4 64 GB/s", both ways), PCIe 5.0 x16 64 GB/s a way (H100/H800/H200/H20
# datasheets: "PCIe Gen5 128 GB/s"). The 910B's host link is taken as PCIe 4.0 x16 until measured (a pinned
# 1 GiB torch.npu copy gives it): its planner figures for offload are the conservative ones.
PCIE5 = (50, "PCIe 5.0 x16")


# Bandwidths are what a ring collective typically reaches per device (bus bandwidth), below the links' line rate:
# 910B HCCS ~160 GB/s in an 8-card Atlas 800T A2, 200GE RoCE per NPU ~20 GB/s; NVLink 3/4 ~230/360 GB/s;
# HDR/NDR InfiniBand per GPU ~22/45 GB/s. Measure yours with `titan-npu doctor` under torchrun and override.
DEVICES: dict[str, Hardware] = {
    spec.name.lower(): spec
    for spec in (
        _spec("910B1", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B2", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B2C", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B3", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B4", "npu", 32, 160, 20, "HCCS", "RoCE"),
        _spec("A100", "cuda", 80, 230, 22, "NVLink", "InfiniBand"),
        _spec("A800", "cuda", 80, 150, 22, "NVLink", "InfiniBand"),
        _spec("H100", "cuda", 80, 360, 45, "NVLink", "InfiniBand", host=PCIE5),
        _spec("H800", "cuda", 80, 150, 45, "NVLink", "InfiniBand", host=PCIE5),
        _spec("H200", "cuda", 141, 360, 45, "NVLink", "InfiniBand", host=PCIE5),
        _spec("H20", "cuda", 96, 360, 45, "NVLink", "InfiniBand", host=PCIE5),
    )
}


def parse_bytes(text: str) -> int:
    """'64GB' / '64G' / '64GiB' / '65536MB' -> bytes; GB means GiB here, as npu-smi and nvidia-smi count. A size
    that is not positive, or is above MAX_DEVICE_MEMORY, is refused (ConfigError)."""
    match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ConfigError(f"--device-memory {text!r} is not a size; write it like 64GB, 80GiB or 32768MB")
    value, unit = float(match.group(1)), match.group(2)
    size = int(value * 1024 ** "_kmgt".index(unit or "_"))
    if size <= 0:
        raise ConfigError(f"--device-memory {text!r}: a device's memory must be positive; write it like 64GB, or "
                          f"leave the option out to take the device's own")
    if size > MAX_DEVICE_MEMORY:
        raise ConfigError(f"--device-memory {text!r} is more than any device holds (at most "
                          f"{MAX_DEVICE_MEMORY // GiB // 1024} TiB here); write the memory of one device, like 64GB")
    return size


def hardware(name: str, memory: str | None = None, intra_node_gbs: float | None = None,
             inter_node_gbs: float | None = None) -> Hardware:
    """A device from the table, with optional overrides of its memory and link bandwidths (GB/s)."""
    spec = DEVICES.get(name.lower().replace("ascend", "").replace("-", "").strip())
    if spec is None:
        raise ConfigError(f"--device {name!r} is unknown (known: {', '.join(s.name for s in DEVICES.values())}); "
                          "pick the closest and set --device-memory / --intra-node-bw / --inter-node-bw")
    changes: dict = {}
    if memory:
        changes["memory_bytes"] = parse_bytes(memory)
    if intra_node_gbs:
        changes["intra_node_bw"] = intra_node_gbs * GB
    if inter_node_gbs:
        changes["inter_node_bw"] = inter_node_gbs * GB
    return replace(spec, **changes)

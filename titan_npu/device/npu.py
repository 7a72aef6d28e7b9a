"""Ascend specifics of the device layer: torch/torch_npu version match, 910B SKU detection, memory fraction.

torch_npu is versioned after the torch it was built for: torch_npu X.Y.Z, X.Y.Z.postN or X.Y.ZrcN needs torch
X.Y.Z exactly (any local suffix such as +cpu aside; the wheel's `Requires-Dist: torch==X.Y.Z.*`). A mismatched pair
fails at import with errors that do not say so, and `import torch` imports torch_npu (its torch.backends entry
point), hence the check before torch is imported (titan_npu/train.py): this module imports torch only when a
function needs a device.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

from titan_npu.errors import ConfigError, DeviceError

# The oldest torch the code runs on: FSDP2's replicate (torch.distributed._composable.replicate_with_fsdp, with
# mesh=) as parallel/fsdp.py calls it arrived in torch 2.10. pyproject.toml states the same floor.
MIN_TORCH = "2.10"
# The torch / torch_npu pairs the NPU path is tested against: the published torch-npu wheels tests/npu reads (each
# pins its torch, `Requires-Dist: torch==X.Y.Z.*`); pyproject.toml's npu extras install them.
TESTED_TORCH_NPU = ("2.13.0", "2.14.0")
_RELEASE = re.compile(r"^\s*(\d+)\.(\d+)\.(\d+)")
# A device row of `npu-smi info`: "| 0     910B3               | OK            | ...".
_NPU_SMI_ROW = re.compile(r"^\|\s*(\d+)\s+((?:Ascend)?9\d\d\w*)\s+\|", re.IGNORECASE)
# get_device_name values that do not name the SKU, so MFU would use the conservative figure.
_GENERIC_NAMES = ("", "npu", "ascend910", "ascend910b", "910b")


def release(version: str) -> str:
    """The X.Y.Z of a version string ("2.5.1.post1" -> "2.5.1", "2.6.0+cpu" -> "2.6.0"); "" if it has none."""
    m = _RELEASE.match(version)
    return ".".join(m.groups()) if m else ""


def check_torch_npu_version(torch_version: str, torch_npu_version: str) -> None:
    """Raise DeviceError naming the packages to install when torch_npu was not built for this torch."""
    needed, have = release(torch_npu_version), release(torch_version)
    if not needed or not have or needed == have:
        return
    raise DeviceError(
        f"torch_npu {torch_npu_version} is built for torch {needed} but torch {torch_version} is installed; "
        f"install the matching pair: `pip install torch=={needed}` (keeping torch_npu {torch_npu_version}) or a "
        f"torch_npu built for torch {have} (`pip install 'torch_npu=={have}.*'`); see docs/npu.md for the CANN "
        "version each pair needs"
    )


def installed_torch_npu_version() -> str | None:
    """torch_npu's version from the package metadata (no import), None if it is not installed as a distribution."""
    for name in ("torch_npu", "torch-npu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_torch_version() -> str:
    """torch's version: the imported module's, else its package metadata (without importing torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__version__", None):
        return str(torch.__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def check_installed_versions(torch_npu_module=None) -> None:
    """Check torch against the installed torch_npu (metadata first; the imported module's __version__ otherwise);
    needs no import of either, so the launcher runs it before `import torch` imports torch_npu."""
    version = installed_torch_npu_version()
    if version is None and torch_npu_module is not None:
        version = getattr(torch_npu_module, "__version__", None)
    if version:
        check_torch_npu_version(installed_torch_version(), str(version))


def parse_npu_smi(text: str) -> dict[int, str]:
    """Chip name per physical NPU id from `npu-smi info` output, e.g. {0: "910B3", 1: "910B3"}."""
    names: dict[int, str] = {}
    for line in text.splitlines():
        m = _NPU_SMI_ROW.match(line)
        if m:
            names.setdefault(int(m.group(1)), m.group(2))
    return names


def physical_npu_id(index: int) -> int:
    """The physical id of visible device `index` under ASCEND_RT_VISIBLE_DEVICES (npu-smi numbers physical ids)."""
    visible = [v.strip() for v in os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def npu_smi_name(index: int, timeout_s: float = 10.0) -> str | None:
    """The chip name npu-smi reports for visible device `index`, None when npu-smi is absent or says nothing."""
    exe = shutil.which("npu-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = parse_npu_smi(out)
    return names.get(physical_npu_id(index)) or (next(iter(names.values())) if names else None)


def npu_device_name(index: int) -> str:
    """The most specific name of NPU `index`: torch.npu.get_device_name, or npu-smi's chip name when that is generic.

    The SKU (910B1..910B4) decides the peak FLOP/s that MFU is measured against.
    """
    import torch

    name = ""
    try:
        name = str(torch.npu.get_device_name(index))
    except Exception:
        pass
    if name.strip().lower() in _GENERIC_NAMES:
        smi = npu_smi_name(index)
        if smi:
            return smi if smi.lower().startswith("ascend") else f"Ascend{smi}"
    return name or "npu"


def set_memory_fraction(device_type: str, index: int, fraction: float) -> bool:
    """Cap this process's share of device memory (0 = no cap); True if a cap was set."""
    if fraction == 0:
        return False
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"training.memory_fraction={fraction} is out of range; use a fraction in (0, 1], or 0 for no cap"
        )
    import torch

    mod = getattr(torch, device_type, None) if device_type != "cpu" else None
    if mod is None or not hasattr(mod, "set_per_process_memory_fraction"):
        return False  # cpu memory is not capped per process
    mod.set_per_process_memory_fraction(fraction, index)
    return True

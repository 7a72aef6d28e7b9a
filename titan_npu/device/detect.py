"""Which device this process trains on: npu > cuda > xpu > cpu, or TITAN_DEVICE; decided at call time."""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from titan_npu.errors import DeviceError

if TYPE_CHECKING:
    from titan_npu.config.schema import CommConfig

DEVICE_TYPES = ("npu", "cuda", "xpu", "cpu")
BACKENDS = {"npu": "hccl", "cuda": "nccl", "xpu": "xccl", "cpu": "gloo"}


# Shared libraries of CANN that torch_npu loads at import: not found = CANN's environment is not set in this shell.
CANN_LIBRARIES = ("libhccl", "libascendcl", "libacl_", "libge_runner", "libgraph", "libruntime", "libascend_hal",
                  "libmsprofiler", "libc_sec")
SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"


def import_torch_npu(required: bool = False) -> ModuleType | None:
    """Import torch_npu if it is installed (it registers the 'npu' device); None when absent.

    The torch / torch_npu version pair is checked before the import: a mismatched pair fails inside it with
    errors that do not name the cause. An install that fails to import (most often CANN's environment not sourced)
    is an error when the NPU is `required`, else a warning and no NPU.
    """
    from titan_npu.device.npu import check_installed_versions

    check_installed_versions()
    try:
        module = importlib.import_module("torch_npu")
    except ModuleNotFoundError as e:
        if e.name == "torch_npu":
            return None
        return _broken_torch_npu(e, required)
    except Exception as e:  # a broken CANN install raises all kinds of errors at import
        return _broken_torch_npu(e, required)
    check_installed_versions(module)  # installs without package metadata carry the version on the module
    return module


def _broken_torch_npu(e: Exception, required: bool) -> None:
    first = str(e).splitlines()[0] if str(e) else ""
    if any(lib in first for lib in CANN_LIBRARIES):
        message = (f"torch_npu is installed but cannot load CANN's libraries ({type(e).__name__}: {first}); "
                   f"source CANN's environment first: `{SET_ENV}` (the set_env.sh of your CANN install), in this "
                   "shell and in the job's launch script on every node")
    else:
        message = (f"torch_npu is installed but failed to import ({type(e).__name__}: {first}); "
                   f"source CANN's set_env.sh (`{SET_ENV}`) and check that torch and torch_npu versions match "
                   "(titan-npu doctor)")
    if required:
        raise DeviceError(message) from e
    warnings.warn(f"{message}; not using the NPU", RuntimeWarning, stacklevel=3)
    return None


def _available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    mod = getattr(torch, device_type, None)
    return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())


def detect_device_type(backend: str = "auto") -> str:
    """The device type to use: TITAN_DEVICE if set, else the first available of npu, cuda, xpu, cpu.

    backend "hccl" (parallel.backend) asks for the NPU as TITAN_DEVICE=npu does.
    """
    forced = os.environ.get("TITAN_DEVICE", "").strip().lower()
    asked_by = f"TITAN_DEVICE={forced}"
    if not forced and backend == "hccl":
        forced, asked_by = "npu", "parallel.backend=hccl"
    if forced:
        if forced not in DEVICE_TYPES:
            raise DeviceError(f"TITAN_DEVICE={forced!r} is not a device type (choose one of {', '.join(DEVICE_TYPES)})")
        if forced == "npu":
            import_torch_npu(required=True)
        if not _available(forced):
            raise DeviceError(f"{asked_by} but no {forced} device is available (unset it to auto-detect)")
        return forced
    if import_torch_npu() is not None and _available("npu"):
        return "npu"
    for device_type in ("cuda", "xpu"):
        if _available(device_type):
            return device_type
    return "cpu"


def planned_device_type(backend: str = "auto") -> str:
    """The device type detection will most likely pick, found without importing torch_npu or touching a device."""
    from titan_npu.device.env import npu_expected

    forced = os.environ.get("TITAN_DEVICE", "").strip().lower()
    if forced in DEVICE_TYPES:
        return forced
    if npu_expected(backend):
        return "npu"
    if torch.version.cuda or torch.version.hip:
        return "cuda"
    return "cpu"


def device_module(device_type: str) -> ModuleType | None:
    """torch.npu / torch.cuda / torch.xpu for an accelerator, None for cpu."""
    return None if device_type == "cpu" else getattr(torch, device_type)


@dataclass(frozen=True)
class DeviceInfo:
    """The device this rank uses and how it talks to the others."""

    type: str
    index: int
    backend: str

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type) if self.type == "cpu" else torch.device(self.type, self.index)

    @property
    def name(self) -> str:
        mod = device_module(self.type)
        if mod is None:
            import platform

            return platform.processor() or platform.machine() or "cpu"
        if self.type == "npu":
            from titan_npu.device.npu import npu_device_name

            return npu_device_name(self.index)  # the 910B SKU decides the MFU peak
        try:
            return str(mod.get_device_name(self.index))
        except Exception:
            return self.type


def setup_device(backend: str = "auto", comm: CommConfig | None = None, deterministic: bool = False,
                 task_queue: int = 1) -> DeviceInfo:
    """Detect the device, bind this process to LOCAL_RANK's device and pick the process-group backend.

    With `comm`, the run's runtime, allocator and collective variables (device/env.py) not yet in the environment
    are set first: each caching allocator reads its configuration once, when the device is bound, and the
    communicators read theirs when they start. Those torch_npu reads at import must already be in place: torch
    imports torch_npu (its torch.backends entry point), and the launcher sets them before it imports torch.
    """
    from titan_npu.device.env import apply_communication_env, exec_timeout_problem

    planned = planned_device_type(backend)
    if comm is not None:
        apply_communication_env(planned, comm, deterministic, task_queue)
    device_type = detect_device_type(backend)
    if comm is not None and device_type != planned:
        apply_communication_env(device_type, comm, deterministic, task_queue)  # still before set_device
    if comm is not None and device_type == "npu":
        problem = exec_timeout_problem(comm.timeout_s)
        if problem:
            warnings.warn(problem, RuntimeWarning, stacklevel=2)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = 0
    mod = device_module(device_type)
    if mod is not None:
        count = mod.device_count()
        if local_rank >= count:
            visible = "ASCEND_RT_VISIBLE_DEVICES" if device_type == "npu" else "CUDA_VISIBLE_DEVICES"
            raise DeviceError(
                f"LOCAL_RANK={local_rank} but only {count} {device_type} device(s) are visible "
                f"({visible}={os.environ.get(visible, '<unset>')}); lower --nproc_per_node or widen {visible}"
            )
        index = local_rank
        mod.set_device(index)
    chosen = BACKENDS[device_type] if backend in ("", "auto") else backend
    return DeviceInfo(device_type, index, chosen)


def synchronize(device: DeviceInfo) -> None:
    """Wait for the device's queued work (no-op on cpu)."""
    mod = device_module(device.type)
    if mod is not None:
        mod.synchronize()

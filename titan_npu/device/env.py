"""Vendor environment variables derived from the config (the user's environment always wins), and what a failed
process-group start most likely means.

torch_npu registers a `torch.backends` entry point (its wheel's entry_points.txt), so `import torch` imports it, and
it reads some of these at import (TORCH_HCCL_TRACE_BUFFER_SIZE, TASK_QUEUE_ENABLE: its
_init/core/optional_features.py): they must be in the environment before torch is imported. The launcher
(titan_npu/train.py) sets them from the config, which it reads without importing torch, then imports torch.
This module imports neither torch nor torch_npu.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from titan_npu.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from titan_npu.config.schema import CommConfig

EXPANDABLE_SEGMENTS = "expandable_segments:True"
# The caching allocator of each device reads its variable once, when the device is first used.
ALLOCATOR_VARS = {"npu": "PYTORCH_NPU_ALLOC_CONF", "cuda": "PYTORCH_CUDA_ALLOC_CONF"}
# The Ascend launch environment read by torch_npu at device start: each rank's host threads bound to the cores near
# its card, and ProcessGroupHCCL's monitor, which aborts a rank whose watchdog hangs (ProcessGroupHCCL.hpp:80-85).
# The flight recorder's buffer and its dump on a timeout come with the watchdog settings (reliability/watchdog.py);
# TASK_QUEUE_ENABLE comes from training.npu_task_queue.
NPU_LAUNCH = {"CPU_AFFINITY_CONF": "1", "TORCH_HCCL_ENABLE_MONITORING": "1"}
# Deterministic mode on npu: HCCL's fixed reduction order and no K-axis shift in matmuls (what torchtitan-npu sets);
# both are read when the runtime and the communicators start.
NPU_DETERMINISTIC = {"HCCL_DETERMINISTIC": "true", "CLOSE_MATMUL_K_SHIFT": "1"}
# HCCL refuses an HCCL_CONNECT_TIMEOUT outside this range (seconds).
HCCL_CONNECT_TIMEOUT_RANGE = (120, 7200)


def npu_expected(backend: str = "auto") -> bool:
    """Whether the run will most likely use the NPU, found without importing torch: TITAN_DEVICE=npu, the hccl
    backend, or (without TITAN_DEVICE) an installed torch_npu."""
    forced = os.environ.get("TITAN_DEVICE", "").strip().lower()
    if forced:
        return forced == "npu"
    return backend == "hccl" or importlib.util.find_spec("torch_npu") is not None


def hccl_exec_timeout(timeout_s: int) -> int:
    """HCCL_EXEC_TIMEOUT (seconds) for a collective timeout of `timeout_s`: a tenth (at least 1 s) below it.

    torch_npu's ProcessGroupHCCL watchdog aborts a collective after the group's timeout, comm.timeout_s, and warns
    when that is <= HCCL_EXEC_TIMEOUT or HCCL_EXEC_TIMEOUT is 0 (never): "The plog may not be recorded"
    (libtorch_npu.so). HCCL's own timeout must fire first, so that its plog records which task hung.
    """
    if timeout_s < 2:
        raise ConfigError(f"comm.timeout_s={timeout_s} leaves no room for HCCL_EXEC_TIMEOUT below it (HCCL must time "
                          "out before the process group's watchdog, or its plog may not be recorded); use 2 or more")
    return timeout_s - max(1, timeout_s // 10)


def exec_timeout_problem(timeout_s: int) -> str | None:
    """Why the environment's HCCL_EXEC_TIMEOUT keeps HCCL's plog from being recorded at a collective timeout of
    `timeout_s`, or None when it does not (or is not a number: HCCL then uses its default)."""
    value = os.environ.get("HCCL_EXEC_TIMEOUT", "").strip()
    if not value.isdigit():
        return None
    seconds = int(value)
    if seconds != 0 and seconds < timeout_s:
        return None
    what = "0 (never)" if seconds == 0 else f"{seconds} s, not below comm.timeout_s={timeout_s}"
    return (f"HCCL_EXEC_TIMEOUT={value} is {what}: torch_npu's watchdog aborts a hung collective after "
            f"comm.timeout_s and warns that HCCL's plog may then not be recorded; unset HCCL_EXEC_TIMEOUT (the run "
            f"sets {hccl_exec_timeout(timeout_s) if timeout_s >= 2 else 1} s) or export a value below comm.timeout_s")


def allocator_env(device_type: str) -> dict[str, str]:
    """expandable_segments for the device's caching allocator, unless the user configured the allocator."""
    var = ALLOCATOR_VARS.get(device_type)
    if var is None:
        return {}
    unified = os.environ.get("PYTORCH_ALLOC_CONF")
    if unified is not None:
        if device_type == "npu" and var in os.environ:
            raise DeviceError(
                f"both PYTORCH_ALLOC_CONF={unified!r} and {var}={os.environ[var]!r} are set and torch_npu's "
                f"allocator refuses the pair; unset one of them"
            )
        return {}  # the device-neutral setting applies
    return {var: EXPANDABLE_SEGMENTS}


def communication_env(device_type: str, comm: CommConfig, deterministic: bool = False,
                      task_queue: int = 1) -> dict[str, str]:
    """The variables this run sets for the device runtime, its allocator and its collective library (only those
    the environment does not set); they must be in place before torch (and with it torch_npu) is imported.

    `task_queue`: torch_npu's TASK_QUEUE_ENABLE level (training.npu_task_queue; 1 is the training setting, 2 is for
    pure inference: torch_npu/npu/utils.py, set_task_queue_enable).
    """
    wanted: dict[str, str] = dict(allocator_env(device_type))
    if device_type == "npu":
        low, high = HCCL_CONNECT_TIMEOUT_RANGE
        if not low <= comm.init_timeout_s <= high:
            raise ConfigError(
                f"comm.init_timeout_s={comm.init_timeout_s} is outside the range HCCL accepts for "
                f"HCCL_CONNECT_TIMEOUT ({low}..{high} s); choose a value in it"
            )
        wanted["HCCL_CONNECT_TIMEOUT"] = str(comm.init_timeout_s)
        wanted["HCCL_EXEC_TIMEOUT"] = str(hccl_exec_timeout(comm.timeout_s))
        if comm.hccl_buffsize_mb > 0:
            wanted["HCCL_BUFFSIZE"] = str(comm.hccl_buffsize_mb)
        if comm.hccl_if_base_port > 0:
            wanted["HCCL_IF_BASE_PORT"] = str(comm.hccl_if_base_port)
        if comm.socket_ifname:
            wanted["HCCL_SOCKET_IFNAME"] = comm.socket_ifname
        wanted["TASK_QUEUE_ENABLE"] = str(task_queue)
        wanted.update(NPU_LAUNCH)
        if deterministic:
            wanted.update(NPU_DETERMINISTIC)
    elif device_type == "cuda":
        wanted["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        if comm.socket_ifname:
            wanted["NCCL_SOCKET_IFNAME"] = comm.socket_ifname
    if comm.socket_ifname:
        wanted["GLOO_SOCKET_IFNAME"] = comm.socket_ifname  # the gloo group beside hccl/nccl, and cpu runs
    return {k: v for k, v in wanted.items() if k not in os.environ}


def apply_communication_env(device_type: str, comm: CommConfig, deterministic: bool = False,
                            task_queue: int = 1) -> dict[str, str]:
    """Set the variables of communication_env in os.environ and return what was set."""
    env = communication_env(device_type, comm, deterministic, task_queue)
    os.environ.update(env)
    return env


# Fragments of the error text that identify the common process-group start failures (checked in this order).
_PORT_IN_USE = ("address already in use", "eaddrinuse", "errno: 98", "errno 98")
_UNREACHABLE = ("connection refused", "timed out", "timeout", "no route to host", "name or service not known",
                "getaddrinfo", "connection reset", "ei0006", "failed to connect", "socket")
_NO_DEVICE = ("invalid device", "device ordinal", "no device", "visible", "set_device", "device id", "ej0001",
              "ee9999", "hccp", "drvmngget", "aclrtsetdevice")
_NO_BACKEND = ("invalid backend", "unknown backend", "not built with", "backend is not available",
               "does not support backend")


def init_failure_message(
    error: BaseException, *, rank: int, backend: str, device_type: str, master_addr: str, master_port: str,
    init_timeout_s: int,
) -> str:
    """One line for a failed process-group start: the likely cause, the fix, and the pointer to `titan-npu doctor`."""
    text = str(error)
    lowered = text.lower()
    first = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    visible = "ASCEND_RT_VISIBLE_DEVICES" if device_type == "npu" else "CUDA_VISIBLE_DEVICES"
    if any(s in lowered for s in _PORT_IN_USE):
        cause = (f"MASTER_PORT={master_port} is already in use on {master_addr}; choose a free port "
                 "(torchrun --master_port) or stop the process that holds it")
    elif any(s in lowered for s in _NO_DEVICE):
        cause = (f"the {backend} communicator could not use this rank's {device_type} device; check that {visible} "
                 f"lists this node's devices, that each rank gets its own device (--nproc_per_node <= devices), and "
                 f"that no other job holds them" + (" (npu-smi info)" if device_type == "npu" else " (nvidia-smi)"))
    elif any(s in lowered for s in _NO_BACKEND):
        cause = (f"the {backend} backend is not available in this install; on NPU import torch_npu (installed and "
                 "matching torch), or set parallel.backend")
    elif any(s in lowered for s in _UNREACHABLE):
        cause = (f"rank {rank} could not reach the master {master_addr}:{master_port} within "
                 f"comm.init_timeout_s={init_timeout_s}s; check that MASTER_ADDR is rank 0's address reachable from "
                 "every node, that rank 0 started, and that the firewall lets the port through")
        if device_type == "npu":
            cause += "; for HCCL also check HCCL_SOCKET_IFNAME / HCCL_IF_BASE_PORT and raise HCCL_CONNECT_TIMEOUT"
    else:
        cause = "check the master address and port, the network, and that the devices are visible"
    return (f"process group init failed on rank {rank} ({backend}, master {master_addr}:{master_port}): {first}; "
            f"{cause}; run `titan-npu doctor` for a full check")

"""Vendor environment variables derived from the [comm] section (the user's environment always wins), and what a
failed process-group start most likely means."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from titan_npu.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from titan_npu.config.schema import CommConfig

EXPANDABLE_SEGMENTS = "expandable_segments:True"
# The caching allocator of each device reads its variable once, when the device is first used.
ALLOCATOR_VARS = {"npu": "PYTORCH_NPU_ALLOC_CONF", "cuda": "PYTORCH_CUDA_ALLOC_CONF"}
# The standard Ascend launch environment (MindSpeed-LLM's and torchtitan-npu's scripts export it), read by torch_npu
# at import and device start: level-2 task-queue pipelining, each rank's host threads bound to the cores near its
# card; and ProcessGroupHCCL's monitor (aborts a rank whose watchdog hangs) with the flight-recorder dump on a
# collective timeout (the recorder's buffer size comes with the watchdog settings, reliability/watchdog.py).
NPU_LAUNCH = {"TASK_QUEUE_ENABLE": "2", "CPU_AFFINITY_CONF": "1", "TORCH_HCCL_ENABLE_MONITORING": "1",
              "TORCH_HCCL_DUMP_ON_TIMEOUT": "1"}
# Deterministic mode on npu: HCCL's fixed reduction order and no K-axis shift in matmuls (what torchtitan-npu sets);
# both are read when the runtime and the communicators start.
NPU_DETERMINISTIC = {"HCCL_DETERMINISTIC": "true", "CLOSE_MATMUL_K_SHIFT": "1"}
# HCCL refuses an HCCL_CONNECT_TIMEOUT outside this range (seconds).
HCCL_CONNECT_TIMEOUT_RANGE = (120, 7200)


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


def communication_env(device_type: str, comm: CommConfig, deterministic: bool = False) -> dict[str, str]:
    """The variables this run sets for the device runtime, its allocator and its collective library (only those
    the environment does not set); they must be in place before the device runtime starts."""
    wanted: dict[str, str] = dict(allocator_env(device_type))
    if device_type == "npu":
        low, high = HCCL_CONNECT_TIMEOUT_RANGE
        if not low <= comm.init_timeout_s <= high:
            raise ConfigError(
                f"comm.init_timeout_s={comm.init_timeout_s} is outside the range HCCL accepts for "
                f"HCCL_CONNECT_TIMEOUT ({low}..{high} s); choose a value in it"
            )
        wanted["HCCL_CONNECT_TIMEOUT"] = str(comm.init_timeout_s)
        wanted["HCCL_EXEC_TIMEOUT"] = str(comm.timeout_s)
        if comm.hccl_buffsize_mb > 0:
            wanted["HCCL_BUFFSIZE"] = str(comm.hccl_buffsize_mb)
        if comm.hccl_if_base_port > 0:
            wanted["HCCL_IF_BASE_PORT"] = str(comm.hccl_if_base_port)
        if comm.socket_ifname:
            wanted["HCCL_SOCKET_IFNAME"] = comm.socket_ifname
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


def apply_communication_env(device_type: str, comm: CommConfig, deterministic: bool = False) -> dict[str, str]:
    """Set the variables of communication_env in os.environ and return what was set."""
    env = communication_env(device_type, comm, deterministic)
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

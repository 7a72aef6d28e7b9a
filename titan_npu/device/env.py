"""Vendor environment variables derived from the [comm] section; the user's environment always wins."""

from __future__ import annotations

import os

from titan_npu.config.schema import CommConfig


def communication_env(device_type: str, comm: CommConfig) -> dict[str, str]:
    """The variables this run sets for its collective library (only those the environment does not set)."""
    wanted: dict[str, str] = {}
    if device_type == "npu":
        wanted["HCCL_CONNECT_TIMEOUT"] = str(comm.init_timeout_s)
        wanted["HCCL_EXEC_TIMEOUT"] = str(comm.timeout_s)
        if comm.hccl_buffsize_mb > 0:
            wanted["HCCL_BUFFSIZE"] = str(comm.hccl_buffsize_mb)
        if comm.hccl_if_base_port > 0:
            wanted["HCCL_IF_BASE_PORT"] = str(comm.hccl_if_base_port)
        if comm.socket_ifname:
            wanted["HCCL_SOCKET_IFNAME"] = comm.socket_ifname
        wanted["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"
    elif device_type == "cuda":
        wanted["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        wanted["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if comm.socket_ifname:
            wanted["NCCL_SOCKET_IFNAME"] = comm.socket_ifname
    if comm.socket_ifname:
        wanted["GLOO_SOCKET_IFNAME"] = comm.socket_ifname  # the gloo group beside hccl/nccl, and cpu runs
    return {k: v for k, v in wanted.items() if k not in os.environ}


def apply_communication_env(device_type: str, comm: CommConfig) -> dict[str, str]:
    """Set the variables of communication_env in os.environ and return what was set."""
    env = communication_env(device_type, comm)
    os.environ.update(env)
    return env

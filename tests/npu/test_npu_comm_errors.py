"""A failed process-group start says what most likely went wrong (port in use, master unreachable, devices not
visible, backend missing), what to do, and points at `titan-npu doctor`."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from titan_npu.config.schema import CommConfig
from titan_npu.device import DeviceInfo
from titan_npu.device.env import init_failure_message
from titan_npu.errors import DeviceError
from titan_npu.parallel.process_group import init_process_group

WHERE = dict(rank=1, backend="hccl", device_type="npu", master_addr="10.0.0.1", master_port="29500",
             init_timeout_s=600)


@pytest.mark.parametrize("error,expected", [
    ("The server socket has failed to listen on any local network address. port: 29500, code: -98, name: "
     "EADDRINUSE, message: address already in use", "MASTER_PORT=29500 is already in use on 10.0.0.1"),
    ("The client socket has timed out after 600000ms while trying to connect to (10.0.0.1, 29500).",
     "could not reach the master 10.0.0.1:29500 within comm.init_timeout_s=600s"),
    ("EI0006: Getting socket times out. Reason: 1. The remote does not initiate a connect request.",
     "HCCL_SOCKET_IFNAME / HCCL_IF_BASE_PORT and raise HCCL_CONNECT_TIMEOUT"),
    ("Initialize:torch_npu/csrc/core/npu/sys_ctrl/npu_sys_ctrl.cpp: call aclrtSetDevice failed, error code 107001",
     "check that ASCEND_RT_VISIBLE_DEVICES lists this node's devices"),
    ("Invalid backend: 'hccl'", "the hccl backend is not available in this install"),
    ("something nobody has seen before", "check the master address and port, the network"),
], ids=["port-in-use", "master-unreachable", "hccl-socket-timeout", "device-not-visible", "no-backend", "other"])
def test_each_common_failure_gets_its_cause_and_fix(error, expected):
    msg = init_failure_message(RuntimeError(error), **WHERE)
    assert expected in msg
    assert msg.startswith("process group init failed on rank 1 (hccl, master 10.0.0.1:29500): RuntimeError: ")
    assert msg.endswith("run `titan-npu doctor` for a full check") and "\n" not in msg


def _join(monkeypatch, rank: int, port: int, init_timeout_s: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    init_process_group(DeviceInfo("cpu", 0, "gloo"), CommConfig(init_timeout_s=init_timeout_s, timeout_s=10))


def test_a_master_port_in_use_is_named(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DeviceError, match=f"MASTER_PORT={port} is already in use on 127.0.0.1"):
            _join(monkeypatch, 0, port, init_timeout_s=5)
    assert not dist.is_initialized()


def test_an_unreachable_master_is_named_with_the_timeout(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DeviceError, match=f"could not reach the master 127.0.0.1:{port} within comm.init_timeout_s=1s"):
        _join(monkeypatch, 1, port, init_timeout_s=1)

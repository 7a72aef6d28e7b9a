"""HCCL's timeouts: a collective aborts after comm.timeout_s, set on the hccl backend of each group (its watchdog
reads the group's timeout, not HCCL_EXEC_TIMEOUT); comm.init_timeout_s must lie in HCCL_CONNECT_TIMEOUT's range."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from titan_npu.config.schema import CommConfig
from titan_npu.device.env import communication_env
from titan_npu.errors import ConfigError
from titan_npu.parallel.process_group import set_collective_timeout


class HcclBackend:
    """Stands for ProcessGroupHCCL: records the timeout its watchdog would use."""

    timeout: timedelta | None = None

    def _set_default_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout


class HcclGroup:
    """A process group whose device backend is hccl (torch_npu registers it for the npu device)."""

    def __init__(self) -> None:
        self.backend = HcclBackend()

    def _get_backend(self, device: torch.device) -> HcclBackend:
        assert device.type == torch._C._get_privateuse1_backend_name()  # "npu" once torch_npu is imported
        return self.backend


def test_the_hccl_collective_timeout_is_comm_timeout_s(monkeypatch):
    group = HcclGroup()
    monkeypatch.setattr(dist, "get_backend", lambda g: "hccl")
    set_collective_timeout(group, CommConfig(timeout_s=900, init_timeout_s=600).timeout_s)
    assert group.backend.timeout == timedelta(seconds=900)


@pytest.mark.parametrize("seconds", [119, 7201])
def test_an_init_timeout_outside_hccl_connect_timeouts_range_is_refused(monkeypatch, seconds):
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    with pytest.raises(ConfigError, match=rf"comm.init_timeout_s={seconds} is outside .* \(120..7200 s\)"):
        communication_env("npu", CommConfig(init_timeout_s=seconds))
    assert communication_env("npu", CommConfig(init_timeout_s=7200))["HCCL_CONNECT_TIMEOUT"] == "7200"

"""HCCL's timeouts: a collective aborts after comm.timeout_s, set on the hccl backend of each group (its watchdog
reads the group's timeout, not HCCL_EXEC_TIMEOUT), HCCL's own HCCL_EXEC_TIMEOUT stays below it so that its plog is
recorded, and comm.init_timeout_s must lie in HCCL_CONNECT_TIMEOUT's range."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from titan_npu.config.schema import CommConfig
from titan_npu.device.env import communication_env, exec_timeout_problem
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


# The library's warning, in fragments around the two numbers (libtorch_npu.so): "The watchdog timeout <ms>ms(which
# is set by init_process_group) is less than or equal to HCCL execution timeout <ms>ms! The plog may not be recorded."
PLOG_WARNING = ("The watchdog timeout ",
                "ms(which is set by init_process_group) is less than or equal to HCCL execution timeout ",
                "ms! The plog may not be recorded.")


@pytest.mark.parametrize("timeout_s", [2, 60, 1800, 7200])
def test_hccl_exec_timeout_stays_below_the_process_groups_watchdog_timeout(each_torch_npu_wheel, monkeypatch,
                                                                           timeout_s):
    strings = each_torch_npu_wheel.library_strings().splitlines()
    assert all(fragment in strings for fragment in PLOG_WARNING)
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    exec_timeout = int(communication_env("npu", CommConfig(timeout_s=timeout_s))["HCCL_EXEC_TIMEOUT"])
    # 0 = never times out, which the library warns about too ("The HCCL execution timeout was set to 0(never
    # timeout), so it is bigger than watchdog timeout")
    assert 0 < exec_timeout < timeout_s
    assert exec_timeout_problem(timeout_s) is None


def test_the_default_comm_timeouts_keep_the_watchdog_strictly_above_hccl_exec_timeout(monkeypatch):
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    comm = CommConfig()
    assert int(communication_env("npu", comm)["HCCL_EXEC_TIMEOUT"]) * 1000 < comm.timeout_s * 1000  # in ms, as there


@pytest.mark.parametrize("value", ["1800", "3600", "0"])
def test_an_hccl_exec_timeout_from_the_environment_that_loses_the_plog_is_named(monkeypatch, value):
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", value)
    assert "HCCL_EXEC_TIMEOUT" not in communication_env("npu", CommConfig(timeout_s=1800))  # the environment wins
    assert "plog" in exec_timeout_problem(1800)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1700")
    assert exec_timeout_problem(1800) is None


def test_a_collective_timeout_too_short_to_fit_hccl_exec_timeout_below_it_is_refused():
    with pytest.raises(ConfigError, match=r"comm.timeout_s=1 leaves no room for HCCL_EXEC_TIMEOUT"):
        communication_env("npu", CommConfig(timeout_s=1))

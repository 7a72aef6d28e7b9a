"""The NPU path of the device layer with the fake torch_npu: detection, binding, backend, HCCL environment, version
check, SKU and peak FLOPs, memory fraction and stats, empty_cache."""

from __future__ import annotations

import os
import stat
import sys

import pytest
import torch

from titan_npu.config.schema import CommConfig
from titan_npu.device import (
    DeviceInfo,
    apply_communication_env,
    detect_device_type,
    empty_cache,
    import_torch_npu,
    memory_stats,
    peak_flops,
    setup_device,
)
from titan_npu.device.npu import (
    check_torch_npu_version,
    npu_device_name,
    parse_npu_smi,
    release,
    set_memory_fraction,
)
from titan_npu.errors import ConfigError, DeviceError

NPU_SMI_OUTPUT = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B2C              | OK            | 95.7        45                0    / 0             |
| 0                         | 0000:5A:00.0  | 0           0    / 0          3440 / 65536         |
+===========================+===============+====================================================+
| 5     910B4               | OK            | 89.9        39                0    / 0             |
| 0                         | 0000:41:00.0  | 0           0    / 0          2922 / 32768         |
+===========================+===============+====================================================+
"""


@pytest.fixture
def clean_env(monkeypatch):
    """A private copy of os.environ, so variables the code under test sets do not leak into other tests."""
    monkeypatch.setattr(os, "environ", os.environ.copy())
    for var in ("TITAN_DEVICE", "ASCEND_RT_VISIBLE_DEVICES", "LOCAL_RANK", "FAKE_NPU_NAME", "FAKE_NPU_COUNT",
                "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(var, None)
    return os.environ


def test_detection_imports_torch_npu_and_prefers_the_npu(fake_torch_npu_importable, clean_env):
    assert not hasattr(torch, "npu")  # nothing is decided at import time: torch_npu is imported by detection
    assert detect_device_type() == "npu"
    assert "torch_npu" in sys.modules and torch.npu.is_available()


def test_titan_device_npu_binds_local_rank_and_selects_hccl(fake_torch_npu_importable, clean_env):
    clean_env.update(TITAN_DEVICE="npu", LOCAL_RANK="3")
    dev = setup_device()
    assert (dev.type, dev.index, dev.backend) == ("npu", 3, "hccl")
    assert torch.npu.current_device() == 3
    assert sys.modules["torch_npu"].npu.state["set_device_calls"] == [3]


def test_ascend_rt_visible_devices_limits_the_local_ranks(fake_torch_npu_importable, clean_env):
    clean_env.update(TITAN_DEVICE="npu", ASCEND_RT_VISIBLE_DEVICES="4,5", LOCAL_RANK="2")
    with pytest.raises(DeviceError, match="ASCEND_RT_VISIBLE_DEVICES=4,5"):
        setup_device()
    clean_env["LOCAL_RANK"] = "1"
    assert setup_device().index == 1


def test_hccl_variables_are_applied_on_the_npu_path_and_the_environment_wins(fake_torch_npu_importable, clean_env):
    clean_env.update(TITAN_DEVICE="npu", HCCL_EXEC_TIMEOUT="77", PYTORCH_NPU_ALLOC_CONF="max_split_size_mb:256")
    for var in ("HCCL_CONNECT_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_IF_BASE_PORT", "HCCL_SOCKET_IFNAME",
                "GLOO_SOCKET_IFNAME"):
        clean_env.pop(var, None)
    dev = setup_device()
    comm = CommConfig(init_timeout_s=600, timeout_s=900, hccl_buffsize_mb=200, hccl_if_base_port=60000,
                      socket_ifname="eth0")
    applied = apply_communication_env(dev.type, comm)
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "600"
    assert os.environ["HCCL_BUFFSIZE"] == "200"
    assert os.environ["HCCL_IF_BASE_PORT"] == "60000"
    assert os.environ["HCCL_SOCKET_IFNAME"] == "eth0" and os.environ["GLOO_SOCKET_IFNAME"] == "eth0"
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "77" and "HCCL_EXEC_TIMEOUT" not in applied
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "max_split_size_mb:256"


@pytest.mark.parametrize("forced", ["npu", ""], ids=["TITAN_DEVICE=npu", "auto-detected"])
def test_the_allocator_configuration_is_in_place_before_torch_npu_is_imported_and_the_card_bound(
        fake_torch_npu_importable, clean_env, forced):
    # torch_npu's caching allocator reads PYTORCH_NPU_ALLOC_CONF once, when set_device creates it.
    if forced:
        clean_env["TITAN_DEVICE"] = forced
    setup_device(comm=CommConfig())
    events = sys.modules["torch_npu"].events
    assert [what for what, _ in events] == ["import", "set_device"]
    assert all(env.get("PYTORCH_NPU_ALLOC_CONF") == "expandable_segments:True" for _, env in events)


def test_the_cuda_allocator_configuration_is_in_place_before_the_device_is_bound(clean_env, monkeypatch):
    # A recorder in place of torch.cuda: the variable must be set when set_device initialises CUDA.
    seen: list[str | None] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    clean_env.update(TITAN_DEVICE="cuda", LOCAL_RANK="1")
    assert setup_device(comm=CommConfig()).index == 1
    assert seen == ["expandable_segments:True"]


def test_pytorch_alloc_conf_is_the_users_allocator_setting(fake_torch_npu_importable, clean_env):
    clean_env.update(TITAN_DEVICE="npu", PYTORCH_ALLOC_CONF="expandable_segments:False")
    setup_device(comm=CommConfig())
    assert "PYTORCH_NPU_ALLOC_CONF" not in os.environ
    clean_env["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"  # torch_npu's allocator raises on the pair
    with pytest.raises(DeviceError, match="both PYTORCH_ALLOC_CONF='expandable_segments:False' and "
                                          "PYTORCH_NPU_ALLOC_CONF='expandable_segments:True' are set"):
        setup_device(comm=CommConfig())


def test_expandable_segments_are_the_npu_allocator_default(fake_torch_npu_importable, clean_env):
    clean_env.pop("PYTORCH_NPU_ALLOC_CONF", None)
    apply_communication_env("npu", CommConfig())
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("torch_version,torch_npu_version", [
    ("2.5.1", "2.5.1"), ("2.5.1+cpu", "2.5.1.post1"), ("2.6.0", "2.6.0rc1"), ("2.1.0a0+git", "2.1.0.post17"),
])
def test_matching_torch_and_torch_npu_versions_pass(torch_version, torch_npu_version):
    check_torch_npu_version(torch_version, torch_npu_version)


def test_a_mismatched_pair_names_both_ways_to_fix_it():
    with pytest.raises(DeviceError) as e:
        check_torch_npu_version("2.6.0+cpu", "2.5.1.post1")
    msg = str(e.value)
    assert "torch_npu 2.5.1.post1 is built for torch 2.5.1 but torch 2.6.0+cpu is installed" in msg
    assert "pip install torch==2.5.1" in msg and "torch_npu==2.6.0.*" in msg
    assert release("2.10.0.post4") == "2.10.0" and release("garbage") == ""


def test_import_refuses_a_torch_npu_built_for_another_torch(fake_torch_npu, clean_env):
    fake_torch_npu.__version__ = "2.1.0.post3"
    with pytest.raises(DeviceError, match="built for torch 2.1.0"):
        import_torch_npu()


@pytest.fixture
def torch_npu_without_cann(tmp_path, monkeypatch, clean_env):
    """A torch_npu whose import fails as it does when CANN's set_env.sh was not sourced."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("torch_npu", None)


@pytest.mark.parametrize("ask", [{"TITAN_DEVICE": "npu"}, {"backend": "hccl"}], ids=["TITAN_DEVICE", "backend"])
def test_an_npu_run_without_cann_sourced_says_to_source_set_env(torch_npu_without_cann, clean_env, ask):
    clean_env.update({k: v for k, v in ask.items() if k == "TITAN_DEVICE"})
    with pytest.raises(DeviceError) as e:
        setup_device(ask.get("backend", "auto"))
    message = str(e.value)
    assert "cannot load CANN's libraries (ImportError: libhccl.so: cannot open shared object file" in message
    assert "`source /usr/local/Ascend/ascend-toolkit/set_env.sh`" in message and "\n" not in message


def test_auto_detection_without_cann_sourced_warns_and_falls_back(torch_npu_without_cann, clean_env):
    with pytest.warns(RuntimeWarning, match="source CANN's environment first.*not using the NPU"):
        assert detect_device_type() in ("cuda", "xpu", "cpu")


def test_no_torch_npu_means_no_npu():
    assert import_torch_npu() is None


def test_npu_smi_table_gives_the_chip_name_per_physical_id():
    assert parse_npu_smi(NPU_SMI_OUTPUT) == {0: "910B2C", 5: "910B4"}


def _fake_npu_smi(tmp_path, monkeypatch) -> None:
    script = tmp_path / "npu-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{NPU_SMI_OUTPUT}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


def test_sku_comes_from_get_device_name_when_it_is_specific(fake_torch_npu, clean_env):
    clean_env["FAKE_NPU_NAME"] = "Ascend910B1"
    dev = DeviceInfo("npu", 0, "hccl")
    assert dev.name == "Ascend910B1"
    assert peak_flops(dev, torch.bfloat16) == 373.9e12


def test_a_generic_device_name_is_refined_by_npu_smi_for_the_visible_card(fake_torch_npu, clean_env, tmp_path,
                                                                          monkeypatch):
    _fake_npu_smi(tmp_path, monkeypatch)
    clean_env.update(FAKE_NPU_NAME="Ascend910B", ASCEND_RT_VISIBLE_DEVICES="5,0")
    assert npu_device_name(0) == "Ascend910B4"  # visible device 0 is physical card 5
    assert npu_device_name(1) == "Ascend910B2C"
    assert peak_flops(DeviceInfo("npu", 0, "hccl"), torch.bfloat16) == 245.8e12


def test_memory_fraction_caps_the_bound_npu(fake_torch_npu, clean_env):
    assert set_memory_fraction("npu", 2, 0.85) is True
    assert fake_torch_npu.npu.state["memory_fraction"] == {2: 0.85}
    assert set_memory_fraction("npu", 0, 0.0) is False
    assert set_memory_fraction("cpu", 0, 0.5) is False
    with pytest.raises(ConfigError, match=r"training.memory_fraction=1.5 .* \(0, 1\]"):
        set_memory_fraction("npu", 0, 1.5)


def test_memory_stats_and_empty_cache_go_to_the_npu(fake_torch_npu, clean_env):
    dev = DeviceInfo("npu", 0, "hccl")
    assert memory_stats(dev).total_gb == 64.0
    empty_cache(dev)
    assert fake_torch_npu.npu.state["empty_cache_calls"] == 1

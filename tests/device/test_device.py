import pytest
import torch

from titan_npu.config.schema import CommConfig
from titan_npu.device import (
    communication_env,
    detect_device_type,
    lookup_peak_flops,
    memory_stats,
    peak_flops,
    setup_device,
)
from titan_npu.errors import DeviceError


def test_a_machine_without_accelerators_detects_cpu_and_gloo(monkeypatch):
    from titan_npu.device import detect

    monkeypatch.delenv("TITAN_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    # Whatever this machine has: no torch_npu and no accelerator reported available.
    monkeypatch.setattr(detect, "import_torch_npu", lambda: None)
    monkeypatch.setattr(detect, "_available", lambda device_type: device_type == "cpu")
    dev = setup_device()
    assert dev.type == "cpu" and dev.backend == "gloo"
    assert dev.torch_device == torch.device("cpu")


def test_titan_device_forces_a_type_and_rejects_an_unknown_one(monkeypatch):
    monkeypatch.setenv("TITAN_DEVICE", "cpu")
    assert detect_device_type() == "cpu"
    monkeypatch.setenv("TITAN_DEVICE", "tpu")
    with pytest.raises(DeviceError, match="TITAN_DEVICE='tpu' is not a device type"):
        detect_device_type()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: forcing cuda succeeds")
def test_forcing_an_absent_accelerator_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TITAN_DEVICE", "cuda")
    with pytest.raises(DeviceError, match="no cuda device is available"):
        detect_device_type()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forcing_a_present_cuda_device_selects_it(monkeypatch):
    monkeypatch.setenv("TITAN_DEVICE", "cuda")
    assert detect_device_type() == "cuda"


def test_explicit_backend_overrides_the_device_default(monkeypatch):
    monkeypatch.delenv("TITAN_DEVICE", raising=False)
    assert setup_device("gloo").backend == "gloo"


def test_peak_flops_table_knows_the_910b_skus_and_gpus():
    assert lookup_peak_flops("Ascend910B1") == 373.9e12
    assert lookup_peak_flops("Ascend910B2") == 353.9e12
    assert lookup_peak_flops("Ascend910B3") == 294.9e12
    assert lookup_peak_flops("Ascend910B4") == 245.8e12
    assert lookup_peak_flops("Ascend910_9392") == 353.9e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert lookup_peak_flops("NVIDIA H200") == 989e12
    assert lookup_peak_flops("a mystery chip") is None


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 NVL", 835), ("NVIDIA H200 NVL", 835), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 80GB HBM3", 989),
    ("NVIDIA L40", 181), ("NVIDIA L40S", 362), ("NVIDIA L4", 121), ("NVIDIA A10", 125), ("NVIDIA A10G", 70),
    ("NVIDIA GH200 480GB", 989), ("NVIDIA H20", 148), ("Tesla V100-SXM2-32GB", 125),
    ("NVIDIA GeForce RTX 4090", 165),
])
def test_a_device_name_takes_its_own_peak_not_one_whose_name_it_contains(name, tflops):
    assert lookup_peak_flops(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA H100 MIG 1g.10gb", "NVIDIA L40X", "Ascend910C9"])
def test_a_name_the_table_does_not_hold_exactly_is_unknown(name):
    assert lookup_peak_flops(name) is None


def test_cpu_peak_is_measured_and_config_override_wins(monkeypatch):
    monkeypatch.setenv("TITAN_DEVICE", "cpu")
    dev = setup_device()
    measured = peak_flops(dev, torch.float32)
    assert 1e8 < measured < 1e14
    assert peak_flops(dev, torch.float32, override_tflops=2.5) == 2.5e12


def test_cpu_memory_reports_process_rss_and_machine_ram(monkeypatch):
    monkeypatch.setenv("TITAN_DEVICE", "cpu")
    mem = memory_stats(setup_device())
    assert 0 < mem.used_gb < mem.total_gb
    assert mem.peak_gb > 0


def test_hccl_variables_come_from_comm_config_unless_the_environment_sets_them(monkeypatch):
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "99")
    env = communication_env("npu", CommConfig(init_timeout_s=600, timeout_s=1200, hccl_buffsize_mb=200))
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"
    assert "HCCL_EXEC_TIMEOUT" not in env  # the user's value wins
    assert env["HCCL_BUFFSIZE"] == "200"
    assert communication_env("cpu", CommConfig()) == {}


def test_cpu_peak_remembers_the_best_reading_so_a_loaded_start_does_not_inflate_mfu(monkeypatch, tmp_path):
    from titan_npu.device import flops

    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype: 5e10)
    assert flops.cpu_peak_flops(torch.float32) == 5e10
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype: 1e10)  # a start on a busy machine
    assert flops.cpu_peak_flops(torch.float32) == 5e10
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype: 8e10)
    assert flops.cpu_peak_flops(torch.float32) == 8e10
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype: 2e10)
    assert flops.cpu_peak_flops(torch.bfloat16) == 2e10  # each dtype has its own entry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_peak_flops.json"]


def test_a_cpu_peak_cache_that_cannot_be_replaced_leaves_no_temporary(monkeypatch, tmp_path):
    from titan_npu.device import flops

    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpu_peak_flops.json").mkdir()  # in the way of the rename, as an unwritable cache would be
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda dtype: 5e10)
    assert flops.cpu_peak_flops(torch.float32) == 5e10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_peak_flops.json"]

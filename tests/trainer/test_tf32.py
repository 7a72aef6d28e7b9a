"""training.tf32: CUDA fp32 matmuls on TF32 tensor cores unless deterministic, and MFU scored against that peak.

torch's precision switches are process-wide flags that exist on cpu builds too, so the setting is checked here;
the matmuls it speeds up run only on a GPU.
"""

import pytest
import torch

from titan_npu.device import DeviceInfo, peak_flops
from titan_npu.trainer.precision import set_fp32_matmul_precision


@pytest.fixture
def restore_matmul_precision():
    before = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = before


@pytest.mark.usefixtures("restore_matmul_precision")
def test_cuda_fp32_matmuls_use_tf32_unless_turned_off_or_deterministic():
    assert set_fp32_matmul_precision("cuda", tf32=True, deterministic=False) is True
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert set_fp32_matmul_precision("cuda", tf32=True, deterministic=True) is False
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert set_fp32_matmul_precision("cuda", tf32=False, deterministic=False) is False
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


@pytest.mark.usefixtures("restore_matmul_precision")
def test_other_devices_leave_the_cuda_flag_alone():
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert set_fp32_matmul_precision("cpu", tf32=True, deterministic=False) is False
    assert set_fp32_matmul_precision("npu", tf32=True, deterministic=False) is False
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_fp32_mfu_is_scored_against_the_peak_that_applies(monkeypatch):
    monkeypatch.setattr(DeviceInfo, "name", property(lambda self: "NVIDIA H100 80GB HBM3"))
    h100 = DeviceInfo("cuda", 0, "nccl")
    assert peak_flops(h100, torch.float32, tf32=True) == 494.5e12
    assert peak_flops(h100, torch.float32, tf32=False) == 67e12
    assert peak_flops(h100, torch.bfloat16, tf32=True) == 989e12  # bf16 matmuls do not use TF32

"""float8 on the NPU against each published torch_npu wheel: the wheel registers torch._scaled_mm (torchao's float8
matmul) and torch._scaled_grouped_mm for the NPU but gives float8 to the Ascend 950 family alone, and registers no
plain torch._grouped_mm; the gate (parallel/float8.py) follows those facts."""

from __future__ import annotations

from titan_npu.config.schema import Float8Config
from titan_npu.parallel import float8

DOCS = "torch_npu/_op_plugin_docs.py"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"


def test_the_wheel_registers_scaled_mm_but_documents_float8_for_the_950_family_only(each_torch_npu_wheel):
    supported = each_torch_npu_wheel.schemas()["supported"]
    assert "_scaled_mm" in supported and "_scaled_grouped_mm" in supported
    assert "_grouped_mm" not in supported  # what torchao's MXFP8 emulation calls: refused on the NPU
    assert "Ascend 950PR/Ascend 950DT数据类型支持float8_e4m3fn" in each_torch_npu_wheel.read(DOCS)
    assert each_torch_npu_wheel.lines(META_FILE, r"SocVersion::Ascend950")


def test_the_gate_passes_an_ascend_950_and_refuses_a_910b_with_the_wheels_scaled_mm(monkeypatch):
    monkeypatch.setattr(float8, "_npu_has_scaled_mm", lambda: True)
    assert float8.npu_has_float8_units("Ascend950PR") and float8.npu_has_float8_units("Ascend950DT")
    assert not float8.npu_has_float8_units("Ascend910B3") and not float8.npu_has_float8_units("Ascend910_9392")
    float8.check_float8_device(Float8Config(enable=True), "npu", device_name="Ascend950PR")

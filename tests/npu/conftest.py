"""The fake torch_npu (tests/npu/fake_torch_npu) made importable for one test and removed after it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

FAKE_DIR = Path(__file__).parent / "fake_torch_npu"


def _forget_torch_npu() -> None:
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    if hasattr(torch, "npu"):
        delattr(torch, "npu")


@pytest.fixture
def fake_torch_npu_importable(monkeypatch):
    """The fake torch_npu on sys.path but not imported: the code under test imports it (attaching torch.npu).

    Afterwards torch_npu is unimported, torch.npu detached, the kernel choice reset to "auto" and the npu op
    backend's learnt state cleared, so no other test sees an NPU.
    """
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed; the fake would shadow it")
    import titan_npu.ops.npu as npu_ops
    from titan_npu.ops import set_kernels

    monkeypatch.syspath_prepend(str(FAKE_DIR))
    monkeypatch.setattr(npu_ops, "_rotary_interleave_supported", None)
    _forget_torch_npu()
    try:
        yield FAKE_DIR
    finally:
        set_kernels("auto")
        _forget_torch_npu()


@pytest.fixture
def fake_torch_npu(fake_torch_npu_importable):
    """The fake torch_npu, imported (torch.npu attached)."""
    return importlib.import_module("torch_npu")

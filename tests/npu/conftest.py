"""The fake torch_npu (tests/npu/fake_torch_npu) made importable for one test and removed after it, and the files
of the published torch_npu wheels that ground it (npu_wheel.py): the pinned one the fake runs on, and each one the
contract tests hold the fake and the project to."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

FAKE_DIR = Path(__file__).parent / "fake_torch_npu"


def _npu_wheel():
    """npu_wheel, imported once per process under that name (the fake imports the same module)."""
    if "npu_wheel" not in sys.modules:
        spec = importlib.util.spec_from_file_location("npu_wheel", FAKE_DIR / "npu_wheel.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["npu_wheel"] = module
        spec.loader.exec_module(module)
    return sys.modules["npu_wheel"]


@pytest.fixture(scope="session")
def torch_npu_wheel():
    """npu_wheel, its functions reading the pinned wheel (the one the fake runs on; downloaded from the package
    index on first use, then cached)."""
    module = _npu_wheel()
    module.wheel_dir()
    return module


@pytest.fixture(scope="session", params=_npu_wheel().TORCH_NPU_VERSIONS)
def each_torch_npu_wheel(request):
    """Each published torch_npu wheel the project supports (npu_wheel.Wheel), downloaded once and cached."""
    wheel = _npu_wheel().WHEELS[request.param]
    wheel.dir()
    return wheel


def _forget_torch_npu() -> None:
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
    if hasattr(torch, "npu"):
        delattr(torch, "npu")


@pytest.fixture
def fake_torch_npu_importable(monkeypatch, torch_npu_wheel):
    """The fake torch_npu on sys.path but not imported: the code under test imports it (attaching torch.npu).

    Afterwards torch_npu is unimported, torch.npu detached, the kernel choice reset to "auto" and the npu op
    backend's learnt state cleared, so no other test sees an NPU.
    """
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed; the fake would shadow it")
    import titan_npu.ops.npu as npu_ops
    from titan_npu.ops import set_kernels

    monkeypatch.syspath_prepend(str(FAKE_DIR))
    monkeypatch.setattr(npu_ops, "_rotary_refused", set())
    monkeypatch.setattr(npu_ops, "_sparse_attention_refused", set())
    monkeypatch.setattr(npu_ops, "_fallbacks_logged", set())
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

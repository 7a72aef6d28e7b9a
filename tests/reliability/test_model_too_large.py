"""A model too large for the memory a rank has is refused in one line naming its size and the fixes, before any
allocation when the free memory says so, and when the allocator itself fails; a model that fits is never refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from titan_npu.cli import main as cli_main

from .conftest import REPO, clean_env, snapshot, tiny_args


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_model_larger_than_the_free_memory_is_refused_before_allocating_it(tmp_path):
    # 10M-wide: 80 TB of weights on a CPU; refused by the size, not by the allocator (or the out-of-memory killer).
    proc = subprocess.run([sys.executable, "train.py", *tiny_args(tmp_path, training__max_steps=1),
                           "--model.dim", "10000000"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("DeviceError: the model is too large for this rank's cpu memory: "), line
    assert "B parameters" in line and "GB is free" in line and "titan-npu plan" in line and "dp_shard" in line
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 4000000000000 bytes. Error code 12 (Cannot allocate memory)"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    MemoryError(),
], ids=["cpu-allocator", "device-oom", "memory-error"])
def test_an_allocator_failure_while_materialising_the_model_is_one_line(tmp_path, capsys, monkeypatch, failure):
    import titan_npu.device.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda *args: None)  # nothing said beforehand: the allocator
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *args, **kwargs: (_ for _ in ()).throw(failure))
    (tmp_path / "keep.txt").write_text("the user's")
    before = snapshot(tmp_path)
    assert cli_main(["train", *tiny_args(tmp_path, training__max_steps=1)]) == 2
    line = _one_line(capsys)
    assert line.startswith("DeviceError: the model is too large for this rank's cpu memory:"), line
    assert "allocating it failed" in line and "smaller model" in line
    assert snapshot(tmp_path) == before


def test_another_runtime_error_while_materialising_is_not_called_a_memory_problem(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "to_empty",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("a bug in a kernel")))
    with pytest.raises(RuntimeError, match="a bug in a kernel"):
        cli_main(["train", *tiny_args(tmp_path, training__max_steps=1)])


def test_the_size_check_counts_only_this_ranks_shard_and_refuses_only_what_cannot_fit(monkeypatch):
    from torch import nn

    import titan_npu.device.memory as memory
    from titan_npu.errors import DeviceError
    from titan_npu.parallel.parallelize import check_fits, local_bytes

    with torch.device("meta"):
        model = nn.Linear(1000, 1000, bias=False)  # 4 MB in fp32
    assert local_bytes(model) == 4_000_000
    monkeypatch.setattr(memory, "available_bytes", lambda *args: 4_000_000)
    check_fits(model, torch.device("cpu"))  # exactly fits: not refused
    monkeypatch.setattr(memory, "available_bytes", lambda *args: 3_999_999)
    with pytest.raises(DeviceError, match="1.0M parameters, 0.0 GB of weights"):
        check_fits(model, torch.device("cpu"))

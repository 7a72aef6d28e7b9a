"""training.deterministic on npu is complete before the process group and its communicators exist: HCCL's fixed
reduction order, no matmul K-shift, and torch's deterministic algorithms."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import titan_npu.trainer.trainer as trainer_module
from titan_npu.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]
DETERMINISM_VARS = ("HCCL_DETERMINISTIC", "CLOSE_MATMUL_K_SHIFT")


class ProcessGroupReached(Exception):
    """Raised by the recorder standing in for init_process_group: what was in place is recorded, the rest skipped."""


def test_deterministic_mode_is_in_place_before_the_process_group_starts(fake_torch_npu_importable, monkeypatch):
    monkeypatch.setattr(os, "environ", os.environ.copy())
    for var in (*DETERMINISM_VARS, "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        os.environ.pop(var, None)
    os.environ["TITAN_DEVICE"] = "npu"
    seen: dict = {}

    def init_process_group(device, comm):
        seen.update(algorithms=torch.are_deterministic_algorithms_enabled(),
                    env={var: os.environ.get(var) for var in DETERMINISM_VARS})
        raise ProcessGroupReached

    monkeypatch.setattr(trainer_module, "init_process_group", init_process_group)
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--training.deterministic", "true"])
    before = torch.are_deterministic_algorithms_enabled()
    try:
        with pytest.raises(ProcessGroupReached):
            trainer_module.Trainer(cfg)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == {"algorithms": True, "env": {"HCCL_DETERMINISTIC": "true", "CLOSE_MATMUL_K_SHIFT": "1"}}
    import_env = sys.modules["torch_npu"].events[0][1]  # what torch_npu saw when it was imported
    assert import_env["HCCL_DETERMINISTIC"] == "true" and import_env["CLOSE_MATMUL_K_SHIFT"] == "1"

"""The whole NPU training path (fake "npu" device, the pinned wheel's op schemas, torch's fused AdamW on the kernel
torch_npu registers) saves, resumes and continues with the losses of the uninterrupted run."""

from __future__ import annotations

import importlib.util

import pytest
from test_npu_training import FAKE_DIR, finish, losses, start_training

RESUME_ARGS = ["--training.deterministic", "true", "--training.dtype", "fp32", "--checkpoint.enable", "true",
               "--checkpoint.save_interval", "2", "--checkpoint.async_save", "false"]


def npu_env(root, name: str) -> dict[str, str]:
    import os

    return {"PYTHONPATH": os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")]),
            "FAKE_NPU_TENSORS": "1", "TITAN_DEVICE": "npu", "FAKE_TORCH_NPU_REPORT": str(root / f"{name}.json")}


def test_one_card_saves_resumes_and_continues_with_the_uninterrupted_losses(tmp_path):
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed; the fake would shadow it")
    ckpt = ["--checkpoint.dir", str(tmp_path / "ckpt"), "--training.max_steps", "4"]
    finish(start_training(tmp_path / "whole", npu_env(tmp_path, "whole"), *RESUME_ARGS, *ckpt))  # saves 2 and 4
    finish(start_training(tmp_path / "resumed", npu_env(tmp_path, "resumed"), *RESUME_ARGS, *ckpt,
                          "--checkpoint.resume", "2", "--checkpoint.overwrite", "true"))
    full = losses(tmp_path / "whole")
    assert len(full) == 4
    assert losses(tmp_path / "resumed") == full[2:]

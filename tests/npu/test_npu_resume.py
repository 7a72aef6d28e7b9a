"""The whole NPU training path (fake "npu" device, the pinned wheel's op schemas, torch's fused AdamW on the kernel
torch_npu registers, the fake's "hccl" backend) saves, resumes and continues with the losses of the uninterrupted
run: on one card, and with FSDP over two cards (two processes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_npu_training import FAKE_DIR, REPO, RUN_VARS, TINY, finish, losses, start_training

from titan_npu.parallel.process_group import free_port

RESUME_ARGS = ["--training.deterministic", "true", "--training.dtype", "fp32", "--checkpoint.enable", "true",
               "--checkpoint.save_interval", "2", "--checkpoint.async_save", "false"]


@pytest.fixture(autouse=True)
def _no_real_torch_npu():
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed; the fake would shadow it")


def npu_env(root: Path, report: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")]),
            "FAKE_NPU_TENSORS": "1", "TITAN_DEVICE": "npu", "FAKE_TORCH_NPU_REPORT": str(root / f"{report}.json")}


def test_one_card_saves_resumes_and_continues_with_the_uninterrupted_losses(tmp_path):
    ckpt = ["--checkpoint.dir", str(tmp_path / "ckpt"), "--training.max_steps", "4"]
    finish(start_training(tmp_path / "whole", npu_env(tmp_path, "whole"), *RESUME_ARGS, *ckpt))  # saves 2 and 4
    finish(start_training(tmp_path / "resumed", npu_env(tmp_path, "resumed"), *RESUME_ARGS, *ckpt,
                          "--checkpoint.resume", "2", "--checkpoint.overwrite", "true"))
    full = losses(tmp_path / "whole")
    assert len(full) == 4
    assert losses(tmp_path / "resumed") == full[2:]


def torchrun_training(root: Path, *args: str) -> None:
    """train.py on two fake cards with FSDP (dp_shard 2), each rank reporting to root/report_<rank>.json."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(RUN_VARS)}
    env.update(npu_env(root, "report_{rank}"))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()),
                           str(REPO / "train.py"), *TINY, "--parallel.dp_shard", "2", "--data.num_workers", "0", *args],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.distributed
def test_fsdp_on_two_cards_saves_resumes_and_continues_with_the_uninterrupted_losses(tmp_path):
    ckpt = ["--checkpoint.dir", str(tmp_path / "ckpt"), "--training.max_steps", "4", "--comm.timeout_s", "900"]
    torchrun_training(tmp_path, *RESUME_ARGS, *ckpt, "--metrics.log_dir", str(tmp_path / "whole"))
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in (0, 1)]
    torchrun_training(tmp_path, *RESUME_ARGS, *ckpt, "--metrics.log_dir", str(tmp_path / "resumed"),
                      "--checkpoint.resume", "2", "--checkpoint.overwrite", "true")
    full = losses(tmp_path / "whole")
    assert len(full) == 4
    assert losses(tmp_path / "resumed") == full[2:]
    for report in reports:
        assert report["calls"]["_fused_adamw_"] == 2 * 4 and report["calls"]["npu_fusion_attention"] == 2 * 4
        # every HCCL group: the collective timeout is comm.timeout_s; determinism was in place before it existed
        assert report["hccl_timeouts"] and set(report["hccl_timeouts"]) == {900.0}
        groups = [env for what, env in report["events"] if what == "hccl_init"]
        assert groups and all(env["deterministic_algorithms"] == "True" and env["HCCL_DETERMINISTIC"] == "true"
                              for env in groups)
        # HCCL times out before the groups' watchdog, so that its plog is recorded (libtorch_npu.so's warning)
        assert all(0 < int(env["HCCL_EXEC_TIMEOUT"]) < 900 for env in groups)

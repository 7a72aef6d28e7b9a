"""A FIFO (named pipe) where a file is expected is refused at once in one line, in a real process: a config file
(before, its open waited for a writer that never came), a Hugging Face config.json, a checkpoint's checkpoint.json.
The data path's FIFOs and devices: tests/reliability/test_bad_inputs_data.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import train_tiny

from .conftest import REPO, clean_env, snapshot

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The step-2 checkpoint of a tiny run."""
    return train_tiny(tmp_path_factory.mktemp("fifo_run"), steps=2) / "step-2"


def _refused(argv: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "titan_npu.cli", *argv], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)  # a wait on the FIFO would end here
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_config_file_that_is_a_fifo_is_refused_at_once(tmp_path, command):
    fifo = tmp_path / "run.toml"
    os.mkfifo(fifo)
    line = _refused([command, "--config", str(fifo)])
    assert line == (f"ConfigError: config file '{fifo}' is a FIFO (named pipe), not a regular file; give the .toml "
                    "or .yaml file itself (copy what a pipe brings into a file first)")


def test_a_hugging_face_config_json_that_is_a_fifo_is_refused_at_once(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    os.mkfifo(hf / "config.json")
    (hf / "model.safetensors").write_bytes(b"")
    before = snapshot(tmp_path)
    line = _refused(["import", "--input", str(hf), "--output", str(tmp_path / "w.pt")])
    assert line.startswith(f"CheckpointError: {hf} holds no weights this tool reads"), line  # no config.json *file*
    assert snapshot(tmp_path) == before


def test_a_checkpoint_json_that_is_a_fifo_is_a_damaged_checkpoint(trained, tmp_path):
    copy = tmp_path / "ckpt" / trained.name
    shutil.copytree(trained, copy)
    (copy / "checkpoint.json").unlink()
    os.mkfifo(copy / "checkpoint.json")
    before = snapshot(tmp_path)
    line = _refused(["export", "--checkpoint", str(copy), "--output", str(tmp_path / "out.pt")])
    assert line.startswith(f"CheckpointError: checkpoint {copy} is incomplete"), line  # no checkpoint.json *file*
    assert snapshot(tmp_path) == before

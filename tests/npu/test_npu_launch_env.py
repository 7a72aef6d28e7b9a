"""The NPU launch environment against each published torch_npu wheel: torch imports torch_npu through its entry point
and torch_npu reads some variables right then, so the launcher sets them before torch; the task-queue level is the
one the wheel documents for training. (A whole `python train.py` run observing the order: test_npu_training.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.config.schema import CommConfig
from titan_npu.device.env import communication_env
from titan_npu.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FAKE_DIR = Path(__file__).resolve().parent / "fake_torch_npu"


def test_torch_imports_torch_npu_through_the_wheels_torch_backends_entry_point(each_torch_npu_wheel):
    entry_points = each_torch_npu_wheel.read(each_torch_npu_wheel.ENTRY_POINTS_FILE)
    assert "[torch.backends]\ntorch_npu = torch_npu:_autoload" in entry_points
    assert each_torch_npu_wheel.lines("torch_npu/__init__.py", r"^def _autoload\(\):")


def test_torch_npu_reads_the_flight_recorder_and_the_task_queue_at_import(each_torch_npu_wheel):
    features = "torch_npu/_init/core/optional_features.py"
    assert each_torch_npu_wheel.lines(features, r'os\.getenv\("TORCH_HCCL_TRACE_BUFFER_SIZE"')
    assert each_torch_npu_wheel.lines(features, r'os\.environ\["TASK_QUEUE_ENABLE"\] = "0"')  # interactive shells
    assert each_torch_npu_wheel.lines("torch_npu/__init__.py", r"^_initialize\(\)$")  # run at import


def test_reading_the_launch_settings_imports_no_torch():
    code = ("import sys; from titan_npu.commands.launch import set_launch_env; "
            "from titan_npu.config.loader import load_config;"
            "cfg = load_config('configs/debug.toml', ['--comm.timeout_s', '900'], model=False);"
            "set_launch_env(cfg); print(sorted(m for m in ('torch', 'torch_npu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_launch_settings_are_the_configs_without_its_model_section(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "no_such_model"\n[comm]\ntimeout_s = 600\n[training]\nnpu_task_queue = 0\n')
    cfg = load_config(path, ["--comm.init_timeout_s", "900"], model=False)
    assert (cfg.comm.timeout_s, cfg.comm.init_timeout_s, cfg.training.npu_task_queue) == (600, 900, 0)
    with pytest.raises(ConfigError, match="no_such_model"):
        load_config(path)


def test_the_task_queue_level_is_the_one_the_wheel_documents_for_training(each_torch_npu_wheel, monkeypatch):
    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    levels = dict(each_torch_npu_wheel.lines("torch_npu/npu/utils.py", r"- ``[012]``: "))
    documented = {line.split("``")[1]: line for line in levels.values()}
    assert "suitable for training" in documented["1"] and "pure-inference only" in documented["2"]
    assert communication_env("npu", CommConfig())["TASK_QUEUE_ENABLE"] == "1"
    assert communication_env("npu", CommConfig(), task_queue=2)["TASK_QUEUE_ENABLE"] == "2"
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "0")
    assert "TASK_QUEUE_ENABLE" not in communication_env("npu", CommConfig())  # the environment wins


def test_a_task_queue_level_torch_npu_refuses_is_refused():
    # set_task_queue_enable raises unless the mode is 0, 1 or 2 (torch_npu/npu/utils.py)
    with pytest.raises(ConfigError, match=r"training.npu_task_queue = 3 must be in \[0, 2\] \(torch_npu.s task-queue"):
        load_config(None, ["--training.npu_task_queue", "3"], model=False)


def test_a_torch_npu_built_for_another_torch_is_refused_before_torch_would_import_it(torch_npu_wheel, tmp_path):
    # `import torch` imports an installed torch_npu, and a mismatched one fails inside torch's import with an error
    # that does not say why: train.py checks the pair from the package metadata first.
    dist_info = torch_npu_wheel.PINNED.write_dist_info(tmp_path / "site")
    text = (dist_info / "METADATA").read_text()
    (dist_info / "METADATA").write_text(re.sub(r"^Version: .*$", "Version: 2.12.0", text, count=1, flags=re.M))
    report = tmp_path / "torch_npu_report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TITAN_", "FAKE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(FAKE_DIR), str(tmp_path / "site"), env.get("PYTHONPATH", "")]),
               TITAN_DEVICE="npu", FAKE_TORCH_NPU_REPORT=str(report))
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "debug.toml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(r"^DeviceError: torch_npu 2.12.0 is built for torch 2.12.0 but torch \S+ is installed",
                     out.stderr, flags=re.M), out.stderr
    assert not report.exists()  # the (fake) torch_npu was never imported

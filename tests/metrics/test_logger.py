"""The sinks: console step line, metrics.jsonl schema, TensorBoard, W&B."""

import json
import logging
import math
import sys

import pytest

from titan_npu.errors import ConfigError
from titan_npu.metrics import MetricsLogger, format_step_line, format_validation_line

RECORD = {
    "step": 20, "loss": 3.25, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 5000.0, "tokens_per_s_per_device": 2500.0,
    "tflops_per_device": 0.1, "mfu": 0.05, "mem_used_gb": 1.0, "mem_peak_gb": 1.5, "mem_total_gb": 16.0,
    "step_time_s": 0.4, "data_time_s": 0.01, "tokens_seen": 40960, "window_steps": 10,
}


def test_step_line_shows_eta_and_flags_at_the_end():
    line = format_step_line(dict(RECORD, eta_s=125.0, flags=["loss_spike step=17 z=6.1"]))
    assert line.endswith("step_time=0.40s, eta=2m05s  [loss_spike step=17 z=6.1]")


def test_validation_line():
    line = format_validation_line({"step": 500, "val_loss": 2.34567, "val_ppl": 10.4412, "val_batches": 10,
                                   "val_tokens": 20480, "val_time_s": 1.23})
    assert line == "[Step 500] val_loss=2.3457, val_ppl=10.44 (10 batches, 20,480 tokens, 1.2s)"


def test_metrics_jsonl_has_one_object_per_logged_step(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0)
    logger.log(RECORD)
    logger.log(dict(RECORD, step=30, loss=float("nan"), flags=["nonfinite_loss step=25"]))
    logger.log_validation({"step": 30, "val_loss": 3.0, "val_ppl": math.exp(3.0), "val_batches": 2,
                           "val_tokens": 512, "val_time_s": 0.1})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert records[0] == RECORD
    assert records[1]["loss"] == "nan" and records[1]["flags"] == ["nonfinite_loss step=25"]
    assert set(records[2]) == {"step", "val_loss", "val_ppl", "val_batches", "val_tokens", "val_time_s"}


def test_console_line_goes_to_the_titan_logger(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, rank=0)
    with caplog.at_level(logging.INFO, logger="titan_npu"):
        logger.log(RECORD)
    logger.close()
    assert any(r.getMessage().startswith("[Step 20] loss=3.2500") for r in caplog.records)


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "logs", rank=1, tensorboard=True, wandb=True)
    logger.log(RECORD)
    logger.close()
    assert not (tmp_path / "logs").exists()


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, rank=0, tensorboard=True)
    logger.log(RECORD)
    logger.log(dict(RECORD, step=30, loss=3.0))
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(20, 3.25), (30, 3.0)]
    assert "tokens_per_s" in acc.Tags()["scalars"]


def test_missing_wandb_is_a_clear_config_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if it were not installed
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsLogger(tmp_path / "logs", rank=0, wandb=True)
    assert not (tmp_path / "logs").exists()


def test_wandb_offline_run_receives_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, rank=0, wandb=True, run_config={"model": {"name": "llama3"}})
    run = logger._wandb
    logger.log(RECORD)
    logger.log(dict(RECORD, step=30, loss=3.0))  # W&B commits a step's values when the next step arrives
    assert run.summary["loss"] == 3.25 and run.summary["_step"] == 20 and run.summary["tokens_per_s"] == 5000.0
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))

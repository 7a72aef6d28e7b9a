"""A real (tiny) training run writes the documented metrics: schema, validation, NaN flags, run info, report."""

import json
import math
from pathlib import Path

import pytest
import torch

DESIGN_KEYS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
               "mfu", "mem_used_gb", "mem_total_gb", "step_time_s", "data_time_s"]
EXTRA_KEYS = ["mem_peak_gb", "tokens_seen", "window_steps", "eta_s"]
VAL_KEYS = {"step", "val_loss", "val_ppl", "val_batches", "val_tokens", "val_time_s"}


def tiny_run(tmp_path: Path) -> Path:
    from fault_hooks import Faults

    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    log_dir = tmp_path / "logs"
    overrides = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                 "--model.max_seq_len", "64", "--training.seq_len", "32", "--training.batch_size", "4",
                 "--training.max_steps", "12", "--metrics.log_dir", str(log_dir), "--metrics.log_interval", "5",
                 "--metrics.tensorboard", "false", "--metrics.progress", "lines", "--metrics.report", "true",
                 "--metrics.peak_tflops", "1.0",
                 "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.enable", "false",
                 "--validation.enable", "true", "--validation.interval", "6", "--validation.steps", "2",
                 "--data.val_fraction", "0.05"]
    cfg = load_config(Path(__file__).parents[2] / "configs" / "debug.toml", overrides)
    trainer = Trainer(cfg)
    Faults(nan_at=7).install(trainer)  # the loss of step 7 becomes NaN
    try:
        trainer.train()
    finally:
        trainer.close()
    return log_dir


def test_tiny_run_writes_metrics_validation_flags_and_report(tmp_path, one_thread):
    log_dir = tiny_run(tmp_path)
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]

    # Log steps: the first (start-up visible), every log_interval-th, the last.
    assert [r["step"] for r in train] == [1, 5, 10, 12]
    assert [r["window_steps"] for r in train] == [1, 4, 5, 2]
    for r in train:
        assert [k for k in r if k in DESIGN_KEYS] == DESIGN_KEYS  # in the order of DESIGN.md
        assert set(EXTRA_KEYS) <= set(r)
        assert r["tokens_seen"] == r["step"] * 4 * 32
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and 0 <= r["data_time_s"] <= r["step_time_s"]
        # Single process: global and per-device figures agree; TFLOPs = tokens/s x FLOPs per token.
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"])
        assert r["mem_used_gb"] > 0 and r["mem_total_gb"] >= r["mem_used_gb"]
    assert train[0]["eta_s"] is None and train[-1]["eta_s"] == 0.0

    # The NaN of step 7 is flagged on the line that covers it (steps 6-10), and only there.
    assert train[2]["flags"] == ["nonfinite_loss step=7"]
    assert all("flags" not in r for r in train if r["step"] != 10)

    # Validation at every 6th step and at the last, as its own records.
    assert [r["step"] for r in val] == [6, 12]
    for r in val:
        assert set(r) == VAL_KEYS
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
        assert r["val_batches"] == 2 and r["val_tokens"] == 2 * 4 * 32

    info = json.loads((log_dir / "run_info.json").read_text())
    run_flops = info["flops_per_token"]
    assert train[-1]["tflops_per_device"] == pytest.approx(train[-1]["tokens_per_s"] * run_flops / 1e12)
    assert info["layout"].startswith("world=1")
    assert (log_dir / "report.png").stat().st_size > 10_000
    md = (log_dir / "report.md").read_text()
    assert "| final loss |" in md and "| final val loss |" in md and "nonfinite_loss step=7" in md


def test_same_validation_batches_give_the_same_loss_each_time(tmp_path, one_thread):
    from titan_npu.config.loader import load_config
    from titan_npu.data import build_tokenizer
    from titan_npu.device import setup_device
    from titan_npu.models.llama import Transformer
    from titan_npu.models.registry import build_model_args
    from titan_npu.trainer.validate import Validator

    cfg = load_config(Path(__file__).parents[2] / "configs" / "debug.toml",
                      ["--model.dim", "64", "--model.n_layers", "1", "--model.n_heads", "4", "--model.n_kv_heads",
                       "2", "--training.seq_len", "32", "--training.batch_size", "4", "--data.val_fraction", "0.05",
                       "--validation.steps", "3"])
    args = build_model_args(cfg.model)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    v = Validator(cfg, build_tokenizer("byte"), 0, 1, setup_device(), args.vocab_size)
    first, second = v.run(model, 1), v.run(model, 2)
    assert first["val_loss"] == second["val_loss"]
    assert model.training  # left as it was found
    # An untrained model is close to uniform over the vocabulary: unit-variance initial logits add about 1/2 nat
    # to ln(vocab) (the same bound as tests/models' untrained-loss test).
    assert math.log(args.vocab_size) - 0.1 < first["val_loss"] < math.log(args.vocab_size) + 1.0

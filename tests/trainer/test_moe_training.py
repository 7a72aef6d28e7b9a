"""configs/debug_moe.toml trains: a falling cross entropy, the load-balancing loss optimised beside it and logged
with the expert load (and dropped tokens under a capacity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_moe.toml"


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


def _run(tmp_path: Path, steps: int, *extra: str) -> list[dict]:
    """debug_moe shrunk to 4 sequences of 64 tokens, every step logged; its training records."""
    overrides = ["--training.seq_len", "64", "--training.batch_size", "4", "--training.max_steps", str(steps),
                 "--lr_scheduler.warmup_steps", "2", "--metrics.log_dir", str(tmp_path / "logs"),
                 "--metrics.log_interval", "1", "--metrics.tensorboard", "false", "--metrics.report", "false",
                 "--metrics.progress", "lines", "--checkpoint.dir", str(tmp_path / "ckpt"),
                 "--checkpoint.enable", "false", *extra]
    trainer = Trainer(load_config(CONFIG, overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_debug_moe_trains_with_a_falling_loss_and_logs_the_aux_loss_and_expert_load(tmp_path, one_thread):
    records = _run(tmp_path, 8)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for r in records:
        # An even load gives top_k = 2 (transformers' normalisation); any load gives at least that much.
        assert 2.0 <= r["aux_loss"] < 8.0
        assert len(r["expert_load_per_layer"]) == 4 and r["expert_load_max_mean"] >= 1.0
        assert "dropped_tokens" not in r  # dropless


def test_the_logged_loss_is_the_cross_entropy_and_the_aux_term_moves_the_weights(tmp_path, one_thread):
    off = _run(tmp_path / "off", 2, "--model.router_aux_loss_coef", "0")
    on = _run(tmp_path / "on", 2, "--model.router_aux_loss_coef", "1.0")
    assert on[0]["loss"] == off[0]["loss"]  # the same weights and batch: the logged loss excludes the aux term
    assert on[0]["aux_loss"] == off[0]["aux_loss"]  # logged even where it is not optimised
    assert on[1]["loss"] != off[1]["loss"]  # the first update differed: the aux term was in the optimised loss


def test_a_capacity_factor_logs_the_dropped_tokens(tmp_path, one_thread):
    records = _run(tmp_path, 2, "--model.capacity_factor", "0.5")
    # Capacity 0.5 x 256 tokens x 2 / 8 experts = 32 per expert per layer: at most half the 512 assignments fit.
    assert all(r["dropped_tokens"] >= 4 * 256 for r in records)

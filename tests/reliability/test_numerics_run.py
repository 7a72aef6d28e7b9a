"""Non-finite steps in a real (single-process) run: skipped and counted, weights untouched, and a run that cannot
make progress stops with a checkpoint of its last good weights, from which the same command resumes.

The NaN comes from the tests' fault hooks (tests/fault_hooks.py), installed on the Trainer.
"""

from __future__ import annotations

import math

import pytest
import torch
from fault_hooks import Faults, train_with_faults

from titan_npu.cli import main as cli_main

from .conftest import checkpoint_steps, model_weights, records, tiny_args


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_step_is_skipped_counted_and_training_continues(tmp_path, capsys):
    args = tiny_args(tmp_path, training__max_steps=5, checkpoint__save_interval=1, checkpoint__keep_last_n=10,
                     checkpoint__async_save=False)
    assert train_with_faults(args, Faults(nan_at=3)) == 0

    by_step = {r["step"]: r for r in records(tmp_path)}
    assert math.isnan(float(by_step[3]["loss"])) and "nonfinite_loss step=3" in by_step[3]["flags"]
    assert all(math.isfinite(by_step[s]["loss"]) for s in (1, 2, 4, 5))
    assert [by_step[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    out = capsys.readouterr().out
    assert "step 3: update skipped (non-finite loss on rank 0); 1 in a row (the run stops at 10)" in out
    ckpt = tmp_path / "ckpt"
    assert _same(model_weights(ckpt / "step-2"), model_weights(ckpt / "step-3"))  # the skipped update left no trace
    assert not _same(model_weights(ckpt / "step-3"), model_weights(ckpt / "step-4"))
    assert all(torch.isfinite(t).all() for t in model_weights(ckpt / "step-5").values())


def test_too_many_skips_stop_with_the_last_good_weights_saved_and_the_same_command_resumes(tmp_path, capsys):
    args = tiny_args(tmp_path, training__max_steps=4, checkpoint__save_interval=1, checkpoint__keep_last_n=10,
                     checkpoint__async_save=False, reliability__max_skipped_steps=1)
    assert train_with_faults(args, Faults(nan_at=3)) == 2

    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("TrainingHalted: steps 3-3: 1 updates in a row were skipped")
    assert f"the weights of step 2 (the last update applied) are saved in {tmp_path / 'ckpt' / 'step-3'}" in err
    assert "lower optimizer.lr or look at the data of these steps" in err
    assert checkpoint_steps(tmp_path) == [1, 2, 3]
    assert _same(model_weights(tmp_path / "ckpt" / "step-2"), model_weights(tmp_path / "ckpt" / "step-3"))

    assert cli_main(["train", *args]) == 0
    assert checkpoint_steps(tmp_path) == [1, 2, 3, 4]  # the bad batch is behind the saved position
    assert records(tmp_path)[-1]["skipped_steps"] == 1  # the count survives the restart

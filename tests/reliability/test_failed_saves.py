"""Folders a run cannot write are refused before anything is built; a save that fails mid-run is tried again, and
when it keeps failing the run stops with the reason, never training on for days without checkpoints."""

from __future__ import annotations

import time

import pytest

from titan_npu.cli import main as cli_main
from titan_npu.reliability import run as reliability_run

from .conftest import checkpoint_steps, records, snapshot, tiny_args


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


@pytest.fixture
def pauses(monkeypatch):
    """The pauses between tries of a failed save, taken instantly; a list of callables runs at each pause."""
    taken: list[float] = []
    actions: list = []

    def pause(seconds: float) -> None:
        taken.append(seconds)
        while actions:
            actions.pop(0)()

    monkeypatch.setattr(time, "sleep", pause)
    return taken, actions


@pytest.mark.parametrize("key", ["checkpoint.dir", "metrics.log_dir"])
def test_a_folder_under_a_regular_file_is_refused_before_step_1_and_nothing_is_created(tmp_path, capsys, key):
    (tmp_path / "notes.txt").write_text("not a folder")
    bad = tmp_path / "notes.txt" / "run"
    args = tiny_args(tmp_path, training__max_steps=2) + [f"--{key}", str(bad)]
    before = snapshot(tmp_path)
    assert cli_main(["train", *args]) == 2
    out = capsys.readouterr()
    assert out.err.strip() == (f"ConfigError: {key} = {bad} cannot be created or written: {tmp_path / 'notes.txt'} "
                               f"is a file, not a folder; pass --{key} a folder this user can create or write")
    assert "model llama3" not in out.out  # refused before the model was built
    assert snapshot(tmp_path) == before


def _block_saves_of(step: int, ckpt) -> callable:
    """A regular file where the save of `step` makes its folder: that save fails until the file is removed."""
    def block(done: int) -> None:
        if done == step - 1:
            ckpt.mkdir(exist_ok=True)
            (ckpt / f"step-{step}.tmp").write_text("in the way")
    return block


def _train(tmp_path, block, **extra) -> int:
    from titan_npu.cli import run_command
    from titan_npu.train import main

    settings = {"training__max_steps": 5, "checkpoint__save_interval": 1, "checkpoint__async_save": False,
                "checkpoint__keep_last_n": 10, **extra}
    args = tiny_args(tmp_path, **settings)
    return run_command(lambda a: main(a, setup=lambda t: t.step_callbacks.append(block)), args)


def test_a_save_that_keeps_failing_is_tried_again_then_stops_the_run_naming_the_last_checkpoint(
        tmp_path, capsys, pauses):
    taken, _ = pauses
    assert _train(tmp_path, _block_saves_of(3, tmp_path / "ckpt")) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.count("\n") == 0 and err.startswith("CheckpointError: checkpoint of step 3 failed on rank 0"), err
    assert (f"the latest complete checkpoint, step 2 in {tmp_path / 'ckpt' / 'step-2'}, is intact; tried 3 times: "
            "the run stops at step 3 rather than train on without checkpoints") in err
    assert taken == list(reliability_run.SAVE_RETRY_DELAYS_S)
    assert "trying again in 5s (try 2 of 3)" in out.out
    assert checkpoint_steps(tmp_path) == [1, 2]
    assert max(r["step"] for r in records(tmp_path)) == 3  # no step after the failed save


def test_a_failed_save_with_no_earlier_checkpoint_does_not_claim_one(tmp_path, capsys, pauses):
    assert _train(tmp_path, _block_saves_of(2, tmp_path / "ckpt"), checkpoint__save_interval=2) == 2
    err = capsys.readouterr().err
    assert f"no complete checkpoint exists in {tmp_path / 'ckpt'} yet" in err and "is intact" not in err


def test_a_save_that_fails_once_succeeds_when_tried_again_and_the_run_finishes(tmp_path, capsys, pauses):
    _, actions = pauses
    ckpt = tmp_path / "ckpt"
    actions.append(lambda: (ckpt / "step-3.tmp").unlink())  # the disk recovers during the first pause
    assert _train(tmp_path, _block_saves_of(3, ckpt)) == 0
    assert checkpoint_steps(tmp_path) == [1, 2, 3, 4, 5]

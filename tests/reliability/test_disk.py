"""Free space before a save: the expected size, refused saves that write nothing and are tried again, and a run
that stops when every try is refused.

The free space of the filesystem is the one thing replaced here (titan_npu.checkpoint.free_space.free_bytes):
filling a real disk in a test is neither safe nor fast.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from titan_npu.checkpoint import free_space, storage
from titan_npu.checkpoint.lock import LOCK_FILE
from titan_npu.checkpoint.manager import CheckpointManager
from titan_npu.cli import main as cli_main
from titan_npu.config.schema import JobConfig
from titan_npu.errors import CheckpointError
from titan_npu.models.llama import LlamaArgs, Transformer

from .conftest import checkpoint_steps, records, tiny_args

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_dim=128, max_seq_len=32)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


def _trained(tmp_path, **checkpoint):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17))
    model(tokens[:, :-1]).sum().backward()
    optimizer.step()
    cfg = JobConfig()
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    manager = CheckpointManager(cfg, [model], optimizer, None, None, SimpleNamespace(step=1, tokens_seen=0),
                                model_args=ARGS)
    return model, optimizer, manager


def test_the_first_estimate_counts_the_model_and_the_optimizer_state(tmp_path):
    model, optimizer, _ = _trained(tmp_path)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * 4 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))  # AdamW keeps a float32 step counter per parameter
    expected = model_bytes + 2 * params + steps  # exp_avg and exp_avg_sq are the size of the parameters
    assert free_space.expected_checkpoint_bytes(tmp_path / "ckpt", [model], [optimizer]) == expected


def test_later_estimates_use_the_size_of_the_newest_checkpoint_on_disk(tmp_path):
    model, optimizer, manager = _trained(tmp_path)
    manager.save(1)
    on_disk = free_space.directory_bytes(tmp_path / "ckpt" / "step-1")
    assert free_space.expected_checkpoint_bytes(tmp_path / "ckpt", [model], [optimizer]) == on_disk


def test_free_space_is_read_from_the_nearest_existing_folder(tmp_path):
    assert free_space.free_bytes(tmp_path / "not" / "yet" / "made") == free_space.free_bytes(tmp_path) > 0


def test_a_save_without_room_writes_nothing_and_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    model, _, manager = _trained(tmp_path, keep_last_n=1)
    manager.save(1)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name != LOCK_FILE)  # the run's own lock
    need = int(1.1 * free_space.directory_bytes(tmp_path / "ckpt" / "step-1"))
    monkeypatch.setattr(free_space, "free_bytes", lambda path: need - 1)
    with pytest.raises(CheckpointError, match=r"not enough free space for a checkpoint in .* \(rank 0 on .*\): "
                                              r".* GB free, .* GB needed .*lower checkpoint.keep_last_n"):
        manager.save(2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name != LOCK_FILE) == before == ["step-1"]
    monkeypatch.setattr(free_space, "free_bytes", lambda path: need)
    manager.save(2)
    assert checkpoint_steps(tmp_path) == [2]  # rotation removed step 1 only after step 2 was complete


def _disk_full_at_saves(monkeypatch, full: set[int]) -> None:
    """Make the n-th save (1-based) of this process find the disk full when n is in `full`."""
    calls = []

    def free_bytes(path):
        calls.append(path)
        return 0 if len(calls) in full else 10**15

    monkeypatch.setattr(free_space, "free_bytes", free_bytes)


def test_a_refused_save_is_tried_again_and_training_goes_on(tmp_path, monkeypatch, capsys):
    pauses = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    _disk_full_at_saves(monkeypatch, {2})
    args = tiny_args(tmp_path, training__max_steps=6, checkpoint__save_interval=2, checkpoint__keep_last_n=5,
                     checkpoint__async_save=False)
    assert cli_main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: not enough free space for a checkpoint" in out
    assert "-- trying again in 5s (try 2 of 3)" in out
    assert pauses == [5.0]
    assert checkpoint_steps(tmp_path) == [2, 4, 6]
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_save_refused_at_every_try_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    _disk_full_at_saves(monkeypatch, {2, 3, 4})
    args = tiny_args(tmp_path, training__max_steps=3, checkpoint__save_interval=1, checkpoint__async_save=False)
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("CheckpointError: not enough free space") and "\n" not in err
    assert (f"the latest complete checkpoint, step 1 in {tmp_path / 'ckpt' / 'step-1'}, is intact; tried 3 times: "
            "the run stops at step 2") in err
    assert checkpoint_steps(tmp_path) == [1]
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    assert storage.is_complete(tmp_path / "ckpt" / "step-1")

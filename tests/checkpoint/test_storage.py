"""Checkpoint directories: only published ones count, publishing is a rename, deletions never expose half a one."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import SafeFileSystemReader, read_metadata
from titan_npu.errors import CheckpointError

from .conftest import fake_checkpoint


def test_only_directories_with_metadata_and_info_are_checkpoints(tmp_path):
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 2)
    (tmp_path / "step-30.tmp").mkdir()
    half = tmp_path / "step-40"
    half.mkdir()
    (half / storage.DCP_METADATA).write_bytes(b"")
    (tmp_path / "notes").mkdir()
    assert [ref.step for ref in storage.list_checkpoints(tmp_path)] == [2, 10]
    assert storage.latest_checkpoint(tmp_path).step == 10


def test_publish_renames_the_temporary_directory_and_writes_the_info_last(tmp_path):
    tmp = storage.tmp_path(tmp_path, 5)
    tmp.mkdir()
    (tmp / storage.DCP_METADATA).write_bytes(b"")
    assert storage.latest_checkpoint(tmp_path) is None
    storage.publish(tmp, tmp_path / "step-5", {"step": 5})
    assert not tmp.exists()
    assert storage.read_info(tmp_path / "step-5")["step"] == 5
    assert storage.latest_checkpoint(tmp_path).step == 5


def test_publishing_over_a_checkpoint_replaces_it_and_leaves_nothing_else(tmp_path):
    fake_checkpoint(tmp_path, 5)
    tmp = storage.tmp_path(tmp_path, 5)
    tmp.mkdir()
    (tmp / storage.DCP_METADATA).write_bytes(b"new")
    storage.publish(tmp, tmp_path / "step-5", {"step": 5, "tokens_seen": 7})
    assert [p.name for p in tmp_path.iterdir()] == ["step-5"]
    assert storage.read_info(tmp_path / "step-5")["tokens_seen"] == 7


def test_a_publish_that_fails_over_a_checkpoint_keeps_the_old_one_under_its_name(tmp_path, monkeypatch):
    fake_checkpoint(tmp_path, 5)
    tmp = storage.tmp_path(tmp_path, 5)
    tmp.mkdir()
    (tmp / storage.DCP_METADATA).write_bytes(b"new")
    replace = os.replace

    def fail_the_move_into_place(src, dst):
        if str(src) == str(tmp):
            raise OSError(5, "Input/output error")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_the_move_into_place)
    with pytest.raises(OSError, match="Input/output error"):
        storage.publish(tmp, tmp_path / "step-5", {"step": 5})
    assert storage.latest_checkpoint(tmp_path).step == 5
    assert (tmp_path / "step-5" / storage.DCP_METADATA).read_bytes() == b""  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5", "step-5.tmp"]


def test_rotate_keeps_the_newest_n(tmp_path):
    for step in (100, 200, 300, 400):
        fake_checkpoint(tmp_path, step)
    assert storage.rotate(tmp_path, 2) == [100, 200]
    assert [ref.step for ref in storage.list_checkpoints(tmp_path)] == [300, 400]
    assert not any(p.name.endswith(storage.DELETING_SUFFIX) for p in tmp_path.iterdir())


def test_clean_unfinished_removes_interrupted_saves_and_deletions_only(tmp_path):
    fake_checkpoint(tmp_path, 1)
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / ".step-0.deleting").mkdir()
    (tmp_path / "mine.tmp").mkdir()
    storage.clean_unfinished(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.tmp", "step-1"]


def test_resolving_a_missing_step_lists_the_available_ones(tmp_path):
    fake_checkpoint(tmp_path, 100)
    fake_checkpoint(tmp_path, 200)
    with pytest.raises(CheckpointError, match=r"step 150 in .* does not exist; complete steps there: 100, 200"):
        storage.resolve_checkpoint("150", tmp_path)


def test_an_interrupted_save_is_reported_as_incomplete(tmp_path):
    (tmp_path / "step-7.tmp").mkdir()
    with pytest.raises(CheckpointError, match=r"step 7 .* is incomplete \(its save did not finish\)"):
        storage.resolve_checkpoint("7", tmp_path)
    with pytest.raises(CheckpointError, match=r"is incomplete .*checkpoint.resume = auto"):
        storage.check_checkpoint_dir(tmp_path / "step-7.tmp")


def test_a_directory_that_is_not_a_checkpoint_says_so(tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(CheckpointError, match=r"is not a checkpoint; expected a step-N directory"):
        storage.check_checkpoint_dir(tmp_path / "weights")
    fake_checkpoint(tmp_path / "run", 3)
    with pytest.raises(CheckpointError, match=r"is not a checkpoint; it holds checkpoints: pass one of them"):
        storage.check_checkpoint_dir(tmp_path / "run")
    fake_checkpoint(tmp_path / "runs" / "b", 5)
    fake_checkpoint(tmp_path / "runs" / "a", 2)
    (tmp_path / "runs" / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"runs is not a checkpoint; its folders a, b hold checkpoints \(each the "
                                              r"checkpoint.dir of a run\): pass one of them, e.g. .*runs/a/step-2$"):
        storage.check_checkpoint_dir(tmp_path / "runs")
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is a file, not a checkpoint directory.*initial_load"):
        storage.check_checkpoint_dir(tmp_path / "model.pt")


class _Boom:
    def __reduce__(self):
        return (print, ("executed",))


def test_the_checkpoint_index_is_read_without_running_code(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "good"), no_dist=True)
    assert tuple(read_metadata(tmp_path / "good").state_dict_metadata["w"].size) == (2,)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / storage.DCP_METADATA).write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"unreadable .*refusing to load builtins.print"):
        read_metadata(bad)
    with pytest.raises(pickle.UnpicklingError):
        SafeFileSystemReader(str(bad)).read_metadata()
    assert "executed" not in capsys.readouterr().out

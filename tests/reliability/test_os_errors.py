"""An operating-system error on a file a command reads or writes (no space, permission denied, read-only, an I/O
error, a name too long, too many open files, ...) ends the command with one line naming the file, the system's
reason and what to do, exit code 2, no traceback (--debug and TITAN_DEBUG=1 show it), in every command.

Tests run as root, for whom chmod denies nothing, and a full disk cannot be made portably: the faults are raised
in-process where the command opens or writes the file (monkeypatch), as the operating system raises them.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_run import train_tiny

from titan_npu.cli import main as cli_main

from .conftest import REPO, clean_env, snapshot, tiny_args


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run's checkpoint folder (checkpoint.dir) with one step."""
    return train_tiny(tmp_path_factory.mktemp("trained"), steps=1)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _fail_open(monkeypatch, matches: Callable[[str], bool], code: int) -> None:
    """open() (builtins, io and os, as numpy, pathlib, the tokenizers and the data path call it) raises
    OSError(code) for the paths `matches` accepts, as the kernel would."""
    real = builtins.open

    def fake(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and matches(os.fspath(file)):
            raise OSError(code, os.strerror(code), os.fspath(file))  # PermissionError for EACCES, ...
        return real(file, *args, **kwargs)

    real_os_open = os.open

    def fake_os_open(path, *args, **kwargs):  # the data path opens with os.open (never blocking on a FIFO)
        if isinstance(path, (str, os.PathLike)) and matches(os.fspath(path)):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake)
    monkeypatch.setattr(io, "open", fake)
    monkeypatch.setattr(os, "open", fake_os_open)


def _disk_full(monkeypatch, folder: Path) -> None:
    """The filesystem of `folder` reports no free space (what statvfs says once a write has filled it)."""
    real = os.statvfs

    def fake(path):
        result = real(path)
        if Path(path).resolve() == folder.resolve():
            return os.statvfs_result((result.f_bsize, result.f_frsize, result.f_blocks, 0, 0, *result[5:]))
        return result

    monkeypatch.setattr(os, "statvfs", fake)


def _corpus(d: Path) -> Path:
    (d / "corpus.txt").write_text("\n\n".join(f"document {i} " + "words and more words " * 20 for i in range(8)))
    return d / "corpus.txt"


def test_export_on_a_full_disk_says_no_space_and_names_the_output(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()

    def full_disk_save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04 part of a zip")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full_disk_save)  # torch.save's words when the disk fills up under it
    _disk_full(monkeypatch, out)
    assert cli_main(["export", "--checkpoint", str(trained), "--output", str(out / "m.pt"), "--dtype", "fp32"]) == 2
    line = _one_line(capsys)
    assert "No space left on device" in line and str(out / "m.pt") in line and "free space" in line, line
    assert list(out.iterdir()) == []  # no half-written file, no temporary left behind


def test_prepare_data_on_a_full_disk_names_the_output_and_keeps_what_a_rerun_resumes_from(tmp_path, capsys,
                                                                                         monkeypatch):
    from titan_npu.data import prepare

    def full(self, tokens, lengths):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a file object's write: no file name

    monkeypatch.setattr(prepare._ShardWriter, "add", full)
    out = tmp_path / "shards"
    assert cli_main(["prepare-data", str(_corpus(tmp_path)), "--output", str(out), "--progress", "lines"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"DataError: cannot write {out} (No space left on device)"), line
    assert "free space" in line, line
    assert not list(out.glob("*.tmp"))


def test_prepare_data_on_an_unreadable_folder_names_it(tmp_path, capsys, monkeypatch):
    inputs = tmp_path / "inputs"
    (inputs / "locked").mkdir(parents=True)
    _corpus(inputs)
    real = os.listdir

    def listdir(path="."):
        if Path(path).name == "locked":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    before = snapshot(tmp_path)
    assert cli_main(["prepare-data", str(inputs), "--output", str(tmp_path / "shards"), "--progress", "lines"]) == 2
    line = _one_line(capsys)
    assert "Permission denied" in line and str(inputs / "locked") in line and "permissions" in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("code, words, workers", [
    (errno.EACCES, "check its permissions", 0),
    (errno.EACCES, "check its permissions", 1),  # raised in a loader worker, re-raised in the run as text
    (errno.EIO, "check the device", 0),
    (errno.EMFILE, "ulimit -n", 0),
])
def test_a_training_shard_that_cannot_be_read_mid_run_ends_the_run_in_one_line(tmp_path, capsys, monkeypatch,
                                                                               code, words, workers):
    from titan_npu.cli import run_command
    from titan_npu.commands.train import main as train_main

    assert cli_main(["prepare-data", str(_corpus(tmp_path)), "--output", str(tmp_path / "shards"),
                     "--progress", "lines"]) == 0
    capsys.readouterr()

    def deny_shards(trainer) -> None:  # the run has started: its index and documents are read, the shards not yet
        _fail_open(monkeypatch, lambda p: p.endswith(".bin"), code)

    args = tiny_args(tmp_path, training__max_steps=2, data__path=tmp_path / "shards", data__num_workers=workers)
    assert run_command(lambda argv: train_main(argv, setup=deny_shards), args) == 2
    line = _one_line(capsys)
    assert os.strerror(code) in line and str(tmp_path / "shards") in line and words in line, line


def test_report_on_a_log_whose_disk_fails_names_the_file(trained, capsys, monkeypatch):
    logs = trained.parent / "logs"
    _fail_open(monkeypatch, lambda p: p.endswith("metrics.jsonl"), errno.EIO)
    assert cli_main(["report", str(logs)]) == 2
    line = _one_line(capsys)
    assert "Input/output error (EIO)" in line and str(logs / "metrics.jsonl") in line, line


def test_train_tokenizer_with_too_many_open_files_says_to_raise_the_limit(tmp_path, capsys, monkeypatch):
    corpus = _corpus(tmp_path)
    _fail_open(monkeypatch, lambda p: p == str(corpus), errno.EMFILE)
    assert cli_main(["train-tokenizer", str(corpus), "--output", str(tmp_path / "tok"), "--vocab-size", "300"]) == 2
    line = _one_line(capsys)
    assert "Too many open files" in line and "ulimit -n" in line, line
    assert not (tmp_path / "tok").exists()


def test_init_weights_on_a_full_disk_leaves_no_half_checkpoint(tmp_path, capsys, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    def full_disk_write(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(filesystem, "_write_item", full_disk_write)
    _disk_full(monkeypatch, tmp_path)
    config = tmp_path / "t.toml"
    config.write_text('[model]\nname = "llama3"\ndim = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n'
                      'vocab_size = 512\nmax_seq_len = 64\n[data]\ntokenizer = "byte"\n')
    assert cli_main(["init-weights", "--config", str(config), "--output", str(tmp_path / "seed")]) == 2
    line = _one_line(capsys)
    assert "No space left on device" in line and str(tmp_path / "seed") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.toml"]


def test_debug_and_titan_debug_show_the_traceback_of_an_os_error(trained, tmp_path, monkeypatch):
    out = str(tmp_path / ("x" * 300 + ".pt"))
    with pytest.raises(OSError):
        cli_main(["export", "--checkpoint", str(trained), "--output", out, "--debug"])
    monkeypatch.setenv("TITAN_DEBUG", "1")
    with pytest.raises(OSError):
        cli_main(["export", "--checkpoint", str(trained), "--output", out])


def test_the_real_commands_say_an_os_error_in_one_line(trained, tmp_path):
    # A file name longer than the filesystem allows (ENAMETOOLONG), and a log folder under a file (ENOTDIR).
    export = subprocess.run([sys.executable, "-m", "titan_npu.cli", "export", "--checkpoint", str(trained),
                             "--output", str(tmp_path / ("x" * 300 + ".pt"))],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert export.returncode == 2 and "Traceback" not in export.stderr, export.stderr[-3000:]
    assert export.stderr.count("\n") == 1 and "File name too long (ENAMETOOLONG)" in export.stderr
    (tmp_path / "a_file").write_text("not a folder")
    train = subprocess.run([sys.executable, "train.py",
                            *tiny_args(tmp_path / "a_file" / "run", training__max_steps=1)],
                           cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert train.returncode == 2 and "Traceback" not in train.stderr, train.stderr[-3000:]
    assert str(tmp_path / "a_file") in train.stderr.strip().splitlines()[-1]


def test_an_os_error_re_raised_as_text_is_still_said_with_its_file_and_fix():
    from titan_npu.os_errors import describe_os_error

    # What torch's DataLoader re-raises in the main process for an error in a worker: the type, a message only.
    worker = PermissionError("Caught PermissionError in DataLoader worker process 0.\nOriginal Traceback (most "
                             "recent call last):\n  File \"x.py\", line 1, in f\nPermissionError: [Errno 13] "
                             "Permission denied: '/data/shard_00001.bin'\n")
    assert describe_os_error(worker) == ("Permission denied (EACCES): /data/shard_00001.bin; check its permissions "
                                         "and owner (ls -l), or choose another folder")
    assert describe_os_error(OSError("8192 requested and 0 written")) == (
        "8192 requested and 0 written; check the path, its permissions and the filesystem")
    assert describe_os_error(OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a", None, "/b")).startswith(
        "Invalid cross-device link (EXDEV): /a -> /b; ")


def test_output_piped_into_a_reader_that_went_away_ends_quietly_like_a_shell_tool():
    """`titan-npu plan --reproduce NAME | head -1`: no BrokenPipeError line or traceback, exit 141 (128 + SIGPIPE)."""
    proc = subprocess.Popen([sys.executable, "-m", "titan_npu.cli", "plan", "--reproduce", "mindspeed_llama2_13b_tp8"],
                            cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone long before the command has imported torch and written its table
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err

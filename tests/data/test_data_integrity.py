"""The data path under OS errors and damage it cannot see at open: one DataError line naming the file and the fix.

No space left or an I/O error while prepare-data writes (nothing left behind, or the finished shards kept for the
resume), a folder that cannot be listed, a shard or input that becomes unreadable mid-run, an id beyond the model's
vocabulary that the open-time sample missed (the loader's per-batch check, also from its worker processes), and
what stays as it was: an unchanged tokens JSONL reuses its index cache, a dataset prepared before checksums still
trains (with a warning line). The faults are monkeypatched hooks in this process (the tests run as root, so chmod
cannot make a file unreadable).
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_run import snapshot, tiny_args

import titan_npu.data.datasets as datasets
import titan_npu.data.files as files
import titan_npu.data.sources as sources
from titan_npu.cli import main as cli_main
from titan_npu.data import build_dataloader, build_tokenizer
from titan_npu.errors import DataError

BYTE = build_tokenizer("byte")
_PROGRESS = re.compile(r"^\d+% \d+ docs")  # prepare-data's progress lines (--progress lines)


def _corpus(d: Path, docs: int = 16) -> Path:
    (d / "corpus").mkdir(exist_ok=True)
    (d / "corpus" / "a.txt").write_text("\n\n".join(f"document {i} " + "words and more words " * 40
                                                    for i in range(docs)))
    return d / "corpus"


def _prepare(d: Path, out: str = "shards", *extra: str) -> int:
    corpus = d / "corpus" if (d / "corpus").is_dir() else _corpus(d)
    return cli_main(["prepare-data", str(corpus), "--output", str(d / out), "--shard-size", "3000",
                     "--progress", "lines", *extra])


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ") and not _PROGRESS.match(ln)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("DataError: "), lines[0]
    return lines[0]


def _fail_fsync_of(monkeypatch, name: str, code: int = errno.ENOSPC) -> None:
    """os.fsync of a file whose name is `name` fails with `code` (a full disk shows there first on many systems)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a file descriptor's file")
def test_no_space_left_in_the_first_shard_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    _corpus(tmp_path)
    before = snapshot(tmp_path)
    _fail_fsync_of(monkeypatch, "shard_00000.bin.tmp")
    rc = cli_main(["prepare-data", str(tmp_path / "corpus"), "--output", str(tmp_path / "new" / "out"),
                   "--shard-size", "3000", "--progress", "lines"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert re.search(r"cannot write .*new/out \(No space left on device\); free space there or choose an --output "
                     r"on another disk$", line), line
    assert snapshot(tmp_path) == before  # not even the new parent folder


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a file descriptor's file")
def test_no_space_left_after_a_finished_shard_keeps_it_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    assert _prepare(tmp_path, "clean") == 0
    _fail_fsync_of(monkeypatch, "shard_00001.bin.tmp")
    assert _prepare(tmp_path) == 2
    line = _one_line(capsys.readouterr().err)
    assert re.search(r"\(No space left on device\); free space there .*; the 1 shard\(s\) finished are kept in "
                     r".*shards: re-run the same command to resume$", line), line
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        ".progress.json", "shard_00000.bin", "shard_00000.docs.npy"]
    monkeypatch.undo()
    assert _prepare(tmp_path) == 0
    assert "resumed after 4 documents" in capsys.readouterr().out
    clean = json.loads((tmp_path / "clean" / "index.json").read_text())
    resumed = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert resumed["shards"] == clean["shards"]  # checksums included: the same bytes


def test_a_folder_that_cannot_be_listed_is_one_line(tmp_path, monkeypatch, capsys):
    _corpus(tmp_path)
    (tmp_path / "corpus" / "private").mkdir()
    real = Path.iterdir

    def iterdir(self: Path):
        if self.name == "private":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    rc = cli_main(["prepare-data", str(tmp_path / "corpus"), "--output", str(tmp_path / "out"), "--progress",
                   "lines"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert re.search(r"cannot list the folder .*corpus/private \(Permission denied\); check its permissions", line)
    assert not (tmp_path / "out").exists()


class _FailingFile(io.RawIOBase):
    """A file whose reads fail with an I/O error past `fail_at` bytes (a disk going bad mid-file)."""

    def __init__(self, data: bytes, fail_at: int):
        self.data, self.fail_at, self.pos = data, fail_at, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.data) + pos
        return self.pos

    def readinto(self, buf) -> int:
        if self.pos >= self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        n = min(len(buf), self.fail_at - self.pos, len(self.data) - self.pos)
        buf[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_an_input_that_fails_mid_read_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    _corpus(tmp_path, docs=200)
    real = sources.open_input

    def open_input(path: Path, fix: str = ""):
        with real(path, fix) as f:
            data = f.read()
        return io.BufferedReader(_FailingFile(data, len(data) // 2), buffer_size=4096)

    monkeypatch.setattr(sources, "open_input", open_input)
    rc = cli_main(["prepare-data", str(tmp_path / "corpus"), "--output", str(tmp_path / "out"), "--progress",
                   "lines"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert re.search(r"corpus/a.txt: cannot be read \(Input/output error\); check or re-download the file", line)
    assert not (tmp_path / "out").exists()


def _refuse_second_open(monkeypatch, name: str, allowed: int = 1) -> None:
    """The first `allowed` opens of a file named `name` succeed (the open-time checks), every later one is refused:
    its permissions changed mid-run."""
    real, opened = os.open, []

    def fake_open(path, flags, *args, **kwargs):
        if str(path).endswith(name):
            opened.append(path)
            if len(opened) > allowed:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def test_a_shard_unreadable_mid_run_stops_training_with_one_line(tmp_path, monkeypatch, capsys):
    assert _prepare(tmp_path) == 0
    capsys.readouterr()
    _refuse_second_open(monkeypatch, "shard_00000.bin")
    rc = cli_main(["train", *tiny_args(tmp_path, training__max_steps=40, checkpoint__interval=1000),
                   "--data.path", str(tmp_path / "shards"), "--training.seed", "3"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2
    assert re.search(r"cannot read .*shards/shard_00000.bin \(Permission denied\); check its permissions", line)


def test_a_tokens_jsonl_unreadable_mid_run_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"tokens": list(range(1, 40))}) + "\n" for _ in range(30)))
    cfg = _cfg(str(path))
    loader = build_dataloader(cfg, BYTE, 0, 1, model_vocab_size=512)
    _refuse_second_open(monkeypatch, "t.jsonl", allowed=0)
    with pytest.raises(DataError, match=r"cannot read .*t.jsonl \(Permission denied\); check its permissions"):
        next(loader)


def _cfg(path: str, num_workers: int = 0):
    from titan_npu.config.schema import JobConfig

    cfg = JobConfig()
    cfg.training.batch_size, cfg.training.seq_len = 2, 32
    cfg.data.path, cfg.data.num_workers, cfg.data.val_fraction = path, num_workers, 0.0
    return cfg


def _old_dataset(folder: Path) -> None:
    index = json.loads((folder / "index.json").read_text())
    index["version"] = 1
    for shard in index["shards"]:
        del shard["checksum"], shard["docs_checksum"]
    (folder / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_id_beyond_the_model_vocab_that_the_open_check_missed_is_refused_before_its_batch(
        tmp_path, monkeypatch, num_workers):
    assert _prepare(tmp_path) == 0
    _old_dataset(tmp_path / "shards")
    shard = tmp_path / "shards" / "shard_00002.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[len(tokens) // 2] = 600  # between the head and tail that the sample below reads
    tokens.tofile(shard)
    monkeypatch.setattr(files, "FULL_DIGEST_BYTES", 0)  # a large shard: only a sample of it is read at open
    monkeypatch.setattr(files, "DIGEST_BLOCKS", 2)
    monkeypatch.setattr(files, "DIGEST_BLOCK_BYTES", 64)
    loader = build_dataloader(_cfg(str(tmp_path / "shards"), num_workers), BYTE, 0, 1, model_vocab_size=512)
    with pytest.raises(DataError) as refused:
        for _ in range(loader.windows.num_windows // 2 + 1):
            next(loader)
    message = str(refused.value)
    assert "\n" not in message and "DataLoader worker" not in message, message
    assert re.search(r"shards/shard_00002.bin holds token id 600 but model.vocab_size is 512 .*re-run titan-npu "
                     r"prepare-data into a new --output", message), message
    loader.close()


def test_a_dataset_prepared_before_checksums_still_trains_with_a_warning_line(tmp_path, capsys):
    assert _prepare(tmp_path) == 0
    _old_dataset(tmp_path / "shards")
    capsys.readouterr()
    assert cli_main(["train", *tiny_args(tmp_path, training__max_steps=1),
                     "--data.path", str(tmp_path / "shards")]) == 0
    out = capsys.readouterr().out  # rank 0's log, where a run's warnings go
    warning = [ln for ln in out.splitlines() if ln.startswith("warning: ")]
    assert len(warning) == 1 and re.search(
        r"shards was prepared before shard checksums \(index.json version 1\): its shards are checked by size only; "
        r"re-run titan-npu prepare-data into a new --output to have them checked by content$", warning[0]), out


def test_an_unchanged_tokens_jsonl_reuses_its_index_cache(tmp_path, monkeypatch, small_cfg):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"tokens": list(range(1, 40))}) + "\n" for _ in range(30)))
    build_dataloader(small_cfg(str(path)), BYTE, 0, 1, model_vocab_size=512)
    cache = tmp_path / "t.jsonl.titan-index.npz"
    assert cache.is_file()

    def parse(*args):
        raise AssertionError("re-parsed although the cache is current")

    monkeypatch.setattr(datasets, "_parse_tokens_line", parse)
    loader = build_dataloader(small_cfg(str(path)), BYTE, 0, 1, model_vocab_size=512)
    assert loader.windows.num_tokens == 30 * 40


def test_an_index_cache_beside_another_file_of_the_same_size_and_mtime_is_rebuilt(tmp_path, small_cfg):
    a, b = tmp_path / "a" / "t.jsonl", tmp_path / "b" / "t.jsonl"
    for path, token in ((a, 100), (b, 900)):
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"tokens": [token] * 30}) + "\n" for _ in range(30)))
    build_dataloader(small_cfg(str(a)), BYTE, 0, 1, model_vocab_size=1024)
    shutil.copy(a.with_name("t.jsonl.titan-index.npz"), b.with_name("t.jsonl.titan-index.npz"))
    st = a.stat()
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match=r"b/t.jsonl:1 holds token id 900 but model.vocab_size is 512"):
        build_dataloader(small_cfg(str(b)), BYTE, 0, 1, model_vocab_size=512)


def test_a_large_file_is_digested_from_a_bounded_sample_that_sees_head_middle_and_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "FULL_DIGEST_BYTES", 1 << 16)
    path = tmp_path / "big.bin"
    data = bytearray(os.urandom(1 << 20))
    path.write_bytes(bytes(data))
    reads = []
    real = files.open_input

    def counting(p, fix=""):
        f = real(p, fix)
        read = f.read
        f_read = lambda n=-1: reads.append(len(r := read(n))) or r  # noqa: E731
        return type("F", (), {"read": staticmethod(f_read), "seek": f.seek, "fileno": f.fileno,
                              "__enter__": lambda s: s, "__exit__": lambda s, *a: f.close()})()

    monkeypatch.setattr(files, "open_input", counting)
    digest = files.content_digest(path)
    assert sum(reads) == files.DIGEST_BLOCKS * files.DIGEST_BLOCK_BYTES  # not the whole megabyte
    last = len(data) - files.DIGEST_BLOCK_BYTES
    for at in (0, last * 32 // (files.DIGEST_BLOCKS - 1) + 10, len(data) - 1):  # within sampled blocks
        changed = bytearray(data)
        changed[at] ^= 0xFF
        path.write_bytes(bytes(changed))
        assert files.content_digest(path) != digest, at

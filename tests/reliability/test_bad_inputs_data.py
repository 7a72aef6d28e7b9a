"""Bad data is refused before a step, by content: exit code 2, one line naming the file and the fix, no traceback,
nothing on disk changed.

A prepared dataset whose files disagree with its index.json (a shard more or fewer, a shard rewritten at the same
size, ids its index does not show, a damaged docs.npy), a tokens JSONL whose offset cache is stale although size
and mtime match, a FIFO or a device where a file belongs (never a blocking open), a .gz / .zst / .parquet that is
not what it says. Training runs go through `titan-npu train` in-process (fast) and a few through `python train.py`;
prepare-data runs as the real command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from titan_npu.cli import main as cli_main

from .conftest import REPO, clean_env, run_train, snapshot, tiny_args

SHARDS = "shards"  # a byte-tokenised corpus in 4 shards of >= 3000 tokens: shard_00000 .. shard_00003


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """One prepare-data output (version 2, with checksums) that each case copies and damages."""
    d = tmp_path_factory.mktemp("prepared")
    (d / "corpus.txt").write_text("\n\n".join(f"document {i} " + "words and more words " * 40 for i in range(16)))
    assert cli_main(["prepare-data", str(d / "corpus.txt"), "--output", str(d / SHARDS), "--shard-size", "3000",
                     "--progress", "lines"]) == 0
    assert len(json.loads((d / SHARDS / "index.json").read_text())["shards"]) == 4
    return d / SHARDS


def _edit_index(folder: Path, edit: Callable[[dict], None]) -> None:
    index = json.loads((folder / "index.json").read_text())
    edit(index)
    (folder / "index.json").write_text(json.dumps(index))


def _as_version_1(index: dict) -> None:
    """index.json as prepare-data wrote it before checksums."""
    index["version"] = 1
    for shard in index["shards"]:
        shard.pop("checksum", None)
        shard.pop("docs_checksum", None)


def _put_tokens(path: Path, at: int, ids: list[int]) -> None:
    """Overwrite tokens at..at+len(ids) of a uint16 shard in place (the size stays)."""
    data = np.fromfile(path, dtype=np.uint16)
    data[at : at + len(ids)] = ids
    data.tofile(path)


def _shard_damage(damage: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    def setup(d: Path, prepared: Path) -> None:
        shutil.copytree(prepared, d / SHARDS)
        damage(d / SHARDS)
    return setup


def _old(damage: Callable[[Path], None] = lambda f: None) -> Callable[[Path, Path], None]:
    """A dataset prepared before checksums, damaged."""
    def both(folder: Path) -> None:
        _edit_index(folder, _as_version_1)
        damage(folder)
    return _shard_damage(both)


def _fifo(rel: str) -> Callable[[Path, Path], None]:
    def setup(d: Path, prepared: Path) -> None:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "corpus").mkdir(exist_ok=True)
        (d / "corpus" / "a.txt").write_text("\n\n".join(f"document {i} " + "words " * 60 for i in range(20)))
        os.mkfifo(d / rel)
    return setup


def _replace_by_fifo(rel: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / rel).unlink()
        os.mkfifo(folder / rel)
    return damage


def _tokens_jsonl(d: Path, rows: int = 40, token: int = 100) -> Path:
    path = d / "t.jsonl"
    path.write_text("".join(json.dumps({"tokens": [token] * 30 + [257]}) + "\n" for _ in range(rows)))
    return path


def _stale_cache(d: Path, prepared: Path) -> None:
    """t.jsonl indexed once (its cache written), then rewritten at the same size with its mtime put back."""
    path = _tokens_jsonl(d)
    assert cli_main(["train", *tiny_args(d / "first", training__max_steps=1), "--data.path", str(path)]) == 0
    shutil.rmtree(d / "first")
    assert (d / "t.jsonl.titan-index.npz").is_file()
    st = path.stat()
    path.write_text(path.read_text().replace("100", "900"))  # ids the model has no embedding for, same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def _prepared_jsonl_rewritten(d: Path, prepared: Path) -> None:
    (d / "c.txt").write_text("\n\n".join(f"document {i} " + "words " * 60 for i in range(20)))
    assert cli_main(["prepare-data", str(d / "c.txt"), "--output", str(d / "pj"), "--format", "jsonl",
                     "--progress", "lines"]) == 0
    path = d / "pj" / "tokens.jsonl"
    path.write_text(path.read_text().replace("119", "911", 1))  # 'w' -> an id beyond the tokenizer, same size


@dataclass
class Case:
    id: str
    setup: Callable[[Path, Path], None] | None
    path: str  # data.path; {d} = the case's folder
    message: str  # a regex the line after 'DataError: ' matches: the file, the problem and the fix
    tokenizer: str = "byte"  # data.tokenizer


def _reverse_shard(folder: Path) -> None:
    path = folder / "shard_00001.bin"
    path.write_bytes(path.read_bytes()[::-1])  # other tokens, the same size


def _object_docs(folder: Path) -> None:
    np.save(folder / "shard_00002.docs.npy", np.array([1, "x", None], dtype=object), allow_pickle=True)


def _cut_docs(folder: Path) -> None:
    path = folder / "shard_00002.docs.npy"
    path.write_bytes(path.read_bytes()[:70])


def _one_more_shard(folder: Path) -> None:
    shutil.copy(folder / "shard_00000.bin", folder / "shard_00004.bin")
    shutil.copy(folder / "shard_00000.docs.npy", folder / "shard_00004.docs.npy")


def _one_fewer_shard(folder: Path) -> None:
    (folder / "shard_00003.bin").unlink()
    (folder / "shard_00003.docs.npy").unlink()


def _lower_entry_max(index: dict) -> None:
    index["shards"][1]["max_token_id"] = 120
    index["max_token_id"] = max(s["max_token_id"] for s in index["shards"])


REPREPARE = r"re-run titan-npu prepare-data into a new --output"

CASES = [
    # FIFOs and devices where a data file belongs: refused at once, never opened to block
    Case("data-path-is-a-fifo", _fifo("t.jsonl"), "{d}/t.jsonl",
         r"t.jsonl is a FIFO \(named pipe\), not a regular file; set data.path to a regular file"),
    Case("data-path-is-a-char-device", None, "/dev/zero", r"^/dev/zero is a character device, not a regular file"),
    Case("tokenizer-is-a-fifo", _fifo("tok/tokenizer.json"), "{d}/corpus",
         r"tokenizer.json is a FIFO \(named pipe\), not a regular file; point data.tokenizer",
         "{d}/tok/tokenizer.json"),
    Case("fifo-in-a-corpus-folder", _fifo("corpus/b.txt"), "{d}/corpus",
         r"corpus/b.txt is a FIFO \(named pipe\), not a regular file; remove it from the folder"),
    Case("shard-is-a-fifo", _shard_damage(_replace_by_fifo("shard_00001.bin")), "{d}/shards",
         r"shard_00001.bin is a FIFO \(named pipe\), not a regular file; " + REPREPARE),
    Case("docs-npy-is-a-fifo", _old(_replace_by_fifo("shard_00001.docs.npy")), "{d}/shards",
         r"shard_00001.docs.npy is a FIFO \(named pipe\), not a regular file; " + REPREPARE),
    Case("index-json-is-a-fifo", _shard_damage(_replace_by_fifo("index.json")), "{d}/shards",
         r"index.json is a FIFO \(named pipe\), not a regular file; " + REPREPARE),
    # a prepared dataset whose files disagree with its index
    Case("one-shard-more-than-listed", _shard_damage(_one_more_shard), "{d}/shards",
         r"shard_00004.bin is not listed in .*index.json \(2 such file\(s\).*; " + REPREPARE),
    Case("one-shard-fewer-than-listed", _shard_damage(_one_fewer_shard), "{d}/shards",
         r"shard_00003.bin is missing but index.json lists it .*; " + REPREPARE),
    Case("shard-rewritten-at-the-same-size", _shard_damage(_reverse_shard), "{d}/shards",
         r"shard .*shard_00001.bin does not match its entry in index.json \(rewritten.*; " + REPREPARE),
    Case("shard-ids-beyond-the-tokenizer", _shard_damage(lambda f: _put_tokens(f / "shard_00002.bin", 500, [300])),
         "{d}/shards", r"shard_00002.bin does not match its entry in index.json"),
    Case("index-max-id-lowered", _shard_damage(lambda f: _edit_index(f, lambda i: i.update(max_token_id=120))),
         "{d}/shards", r"index.json says max_token_id 120 but its shards' entries say 257 \(edited\?\); " + REPREPARE),
    Case("index-shard-max-id-lowered", _shard_damage(lambda f: _edit_index(f, _lower_entry_max)), "{d}/shards",
         r"shard_00001.bin does not match its entry in index.json"),
    Case("index-max-id-beyond-the-tokenizer", _shard_damage(lambda f: _edit_index(
         f, lambda i: i["tokenizer"].update(vocab_size=200))), "{d}/shards",
         r"index.json says its tokens go up to id 257, beyond its tokenizer's vocab_size 200"),
    Case("index-dtype-edited", _shard_damage(lambda f: _edit_index(f, lambda i: i.update(dtype="object"))),
         "{d}/shards", r"index.json names dtype object, not uint16 or uint32; " + REPREPARE),
    Case("index-shard-entry-without-file", _shard_damage(lambda f: _edit_index(f, lambda i: i["shards"][0].pop(
         "file"))), "{d}/shards", r"index.json is damaged or edited \(KeyError: 'file'\); " + REPREPARE),
    Case("docs-npy-truncated", _shard_damage(_cut_docs), "{d}/shards",
         r"shard_00002.docs.npy does not match its checksum in index.json"),
    Case("docs-npy-object-array", _shard_damage(_object_docs), "{d}/shards",
         r"shard_00002.docs.npy does not match its checksum in index.json"),
    # prepared before checksums: sizes, docs.npy and a sample of the ids are still checked
    Case("old-dataset-docs-npy-truncated", _old(_cut_docs), "{d}/shards",
         r"shard_00002.docs.npy is not a valid document index \(.*\); " + REPREPARE),
    Case("old-dataset-docs-npy-object-array", _old(_object_docs), "{d}/shards",
         r"shard_00002.docs.npy is not a valid document index \(Object arrays cannot be loaded"),
    Case("old-dataset-shard-ids-beyond-its-index", _old(lambda f: _put_tokens(f / "shard_00001.bin", 7, [600] * 9)),
         "{d}/shards", r"shard .*shard_00001.bin holds token id 600 but index.json says its largest is 257"),
    Case("old-dataset-one-shard-more", _old(_one_more_shard), "{d}/shards", r"shard_00004.bin is not listed"),
    # tokens JSONL
    Case("stale-jsonl-cache-same-size-and-mtime", _stale_cache, "{d}/t.jsonl",
         r"t.jsonl:1 holds token id 900 but model.vocab_size is 512"),
    Case("jsonl-token-id-beyond-int64", lambda d, p: (d / "t.jsonl").write_text(
         '{"tokens": [1, 2, 99999999999999999999999]}\n' * 40), "{d}/t.jsonl",
         r"t.jsonl:1: 'tokens' must be a non-empty list of non-negative ints \(token ids below 2\*\*31\)"),
    Case("prepared-jsonl-rewritten-at-the-same-size", _prepared_jsonl_rewritten, "{d}/pj",
         r"pj/tokens.jsonl does not match its checksum in .*index.json .*; " + REPREPARE),
]


def _error_line(err: str) -> str:
    """The refusal: the one line that is not a warning."""
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_data_is_refused_in_one_line_before_a_step_and_changes_nothing(case, tmp_path, capsys, prepared):
    d = tmp_path / "case"
    d.mkdir()
    if case.setup is not None:
        case.setup(d, prepared)
    before = snapshot(d) if not any(p.is_fifo() for p in d.rglob("*")) else _names(d)
    capsys.readouterr()

    rc = cli_main(["train", *tiny_args(d, training__max_steps=1), "--data.path", case.path.format(d=d),
                   "--data.tokenizer", case.tokenizer.format(d=d)])

    out, err = capsys.readouterr()
    line = _error_line(err)
    assert rc == 2, err
    kind, _, message = line.partition(": ")
    assert kind == "DataError", line
    assert re.search(case.message, message), message
    assert "[Step" not in out
    after = snapshot(d) if not any(p.is_fifo() for p in d.rglob("*")) else _names(d)
    assert after == before, "a refused run changed files"


def _names(d: Path) -> dict[str, str]:
    """The snapshot of a folder holding a FIFO (whose bytes cannot be read): names, and the bytes of regular files."""
    return {str(p.relative_to(d)): f"-> {os.readlink(p)}" if p.is_symlink() else "fifo" if p.is_fifo()
            else "dir" if p.is_dir() else p.read_bytes().hex() for p in sorted(d.rglob("*"))}


# The same as real processes: `python train.py` exits 2 with one line and no traceback, and does not block.
@pytest.mark.parametrize("case_id", ["data-path-is-a-fifo", "shard-rewritten-at-the-same-size",
                                     "old-dataset-docs-npy-object-array", "stale-jsonl-cache-same-size-and-mtime"])
def test_python_train_py_refuses_bad_data_in_one_line(case_id, tmp_path, prepared):
    case = next(c for c in CASES if c.id == case_id)
    if case.setup is not None:
        case.setup(tmp_path, prepared)
    before = _names(tmp_path)
    proc = run_train([*tiny_args(tmp_path, training__max_steps=1), "--data.path", case.path.format(d=tmp_path)],
                     timeout=120)
    line = _error_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("DataError: ") and re.search(case.message, line), line
    assert "Traceback" not in proc.stdout
    assert _names(tmp_path) == before


# ---- prepare-data as the real command

def prepare_data(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_npu.cli", "prepare-data", *args, "--progress", "lines"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def _corpus(d: Path) -> None:
    (d / "corpus").mkdir(exist_ok=True)
    (d / "corpus" / "a.txt").write_text("\n\n".join(f"document {i} " + "words " * 60 for i in range(20)))


def _write(rel: str, data: bytes) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return setup


def _gzip_of(text: bytes) -> bytes:
    import gzip

    return gzip.compress(text)


PREPARE_CASES = [
    # (id, setup, inputs, message)
    ("input-is-a-fifo", lambda d: os.mkfifo(d / "c.txt"), ["{d}/c.txt"],
     r"c.txt is a FIFO \(named pipe\), not a regular file; give a regular file or a folder of them"),
    ("input-is-dev-zero", None, ["/dev/zero"], r"DataError: /dev/zero is a character device, not a regular file"),
    ("input-is-a-dangling-symlink", lambda d: os.symlink(d / "gone.txt", d / "c.txt"), ["{d}/c.txt"],
     r"input .*c.txt is a symlink to .*gone.txt, which does not exist; fix or remove the link"),
    ("fifo-in-the-input-folder", lambda d: (_corpus(d), os.mkfifo(d / "corpus" / "b.jsonl")), ["{d}/corpus"],
     r"corpus/b.jsonl is a FIFO \(named pipe\), not a regular file; remove it from the folder"),
    ("dev-zero-linked-in-the-input-folder", lambda d: (_corpus(d), os.symlink("/dev/zero", d / "corpus" / "z.txt")),
     ["{d}/corpus"], r"corpus/z.txt is a character device, not a regular file; remove it from the folder"),
    ("tokenizer-is-a-fifo", lambda d: (_corpus(d), os.mkfifo(d / "tokenizer.json")), ["{d}/corpus", "--tokenizer",
     "{d}/tokenizer.json"], r"tokenizer.json is a FIFO \(named pipe\), not a regular file; point data.tokenizer"),
    ("fifo-matched-by-a-glob", lambda d: (_corpus(d), os.mkfifo(d / "corpus" / "b.txt")), ["{d}/corpus/*.txt"],
     r"corpus/b.txt is a FIFO \(named pipe\), not a regular file; leave it out of the pattern"),
    ("zst-that-is-not-zstd", _write("c.txt.zst", b"plain text, not zstd\n"), ["{d}/c.txt.zst"],
     r"c.txt.zst: is not a valid .zst file or is damaged \(.*\); check or re-download the file"),
    ("zst-that-is-gzip", _write("c.jsonl.zst", _gzip_of(b'{"text": "hello"}\n')), ["{d}/c.jsonl.zst"],
     r"c.jsonl.zst: is not a valid .zst file or is damaged"),
    ("gz-that-is-not-gzip", _write("c.txt.gz", b"plain text, not gzip\n"), ["{d}/c.txt.gz"],
     r"c.txt.gz: is not a valid .gz file or is damaged \(Not a gzipped file"),
    ("gz-truncated", _write("c.txt.gz", _gzip_of(" ".join(map(str, range(20000))).encode())[:2000]), ["{d}/c.txt.gz"],
     r"c.txt.gz: is not a valid .gz file or is damaged"),
    ("parquet-that-is-not-parquet", _write("c.parquet", b"PAR1 and then nothing of the kind PAR1"),
     ["{d}/c.parquet"], r"c.parquet: not a readable Parquet file \(.*\); check the file"),
    ("parquet-with-a-damaged-row-group", lambda d: _damaged_parquet(d / "c.parquet"), ["{d}/c.parquet"],
     r"c.parquet: row group 1 cannot be read \(.*\); check or re-download the file"),
]


def _damaged_parquet(path: Path) -> None:
    """A Parquet file whose second row group's pages are overwritten (its footer intact)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"document {i} " + "words " * 50 for i in range(200)]}), path,
                   row_group_size=100, compression="snappy")
    meta = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = meta.dictionary_page_offset or meta.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", PREPARE_CASES, ids=[c[0] for c in PREPARE_CASES])
def test_prepare_data_refuses_an_input_that_is_not_a_file_or_not_what_it_says_in_one_line(case, tmp_path):
    _, setup, inputs, message = case
    if setup is not None:
        setup(tmp_path)
    before = _names(tmp_path)
    proc = prepare_data(*[i.format(d=tmp_path) for i in inputs], "--output", str(tmp_path / "new" / "out"))
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc.stderr)
    assert line.startswith("DataError: ") and re.search(message, line), line
    assert _names(tmp_path) == before, "prepare-data left something behind"


def test_prepare_data_names_the_entries_of_a_folder_that_it_skips(tmp_path):
    _corpus(tmp_path)
    os.symlink(tmp_path / "moved.txt", tmp_path / "corpus" / "b.txt")
    (tmp_path / "corpus" / "notes.md").write_text("not a corpus file")
    proc = prepare_data(str(tmp_path / "corpus"), "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warning) == 1, proc.stderr
    assert re.search(r"corpus: skipped 2 entries that are not inputs: .*b.txt \(a symlink to .*moved.txt, which "
                     r"does not exist\); .*notes.md \(not .txt/.jsonl/.json/.parquet\)", warning[0]), warning[0]
    assert json.loads((tmp_path / "out" / "index.json").read_text())["num_documents"] == 20

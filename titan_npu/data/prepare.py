"""prepare-data: raw corpora -> token shards (or the guide's tokens JSONL), parallel, atomic, resumable.

Output folder: shard_NNNNN.bin (token ids, uint16 when the vocab fits else uint32), shard_NNNNN.docs.npy (document
end offsets), for chat data (--format chat / instruction) shard_NNNNN.mask.bin (one byte per token: 1 = an
assistant token, the loss is taken on it), index.json written last. A shard exists under its final name only once
complete; .progress.json records finished shards so an interrupted run resumes after the last of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import shutil
from collections import deque
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

import numpy as np

from titan_npu.atomic import atomic_path, atomic_write_json
from titan_npu.config.options import COMMAND_OPTIONS
from titan_npu.data.chat import ChatTemplate, RecordFormat, encode_records, load_chat_template
from titan_npu.data.datasets import (
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_VERSION,
    PROGRESS_FILE,
    TOKENS_JSONL,
    jsonl_checksum,
    read_index,
    shard_checksum,
)
from titan_npu.data.files import content_digest, os_error
from titan_npu.data.progress import Progress
from titan_npu.data.sources import BadRecords, HFSource, Input, discover_inputs, open_reader
from titan_npu.data.tokenizer import Tokenizer, build_tokenizer
from titan_npu.errors import DataError
from titan_npu.os_errors import fix_for
from titan_npu.outputs import refuse_protected, shown

PREPARE_FORMATS = ("bin", "jsonl", "chat", "instruction")
CHUNK_CHARS = 1 << 20  # text per tokenisation task: large enough to amortise process hand-off
CHUNK_DOCS = 4096


@dataclass
class PrepareResult:
    """What a prepare run did: up_to_date means nothing was redone."""

    output: Path
    up_to_date: bool
    num_documents: int
    num_tokens: int
    num_shards: int
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)
    resumed_docs: int = 0
    seconds: float = 0.0
    input_bytes: int = 0


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _ChunkTokenizer:
    """Texts -> one token array + per-document lengths; runs in the worker processes."""

    def __init__(self, spec: str, dtype: str, max_seq_len: int, tokenizer: Tokenizer | None = None):
        self.spec = spec
        self.tokenizer = tokenizer or build_tokenizer(spec)
        self.dtype = np.dtype(dtype)
        self.max_seq_len = max_seq_len

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        tokens, lengths = self.tokenizer.encode_flat(texts, bos=True, eos=True)
        if self.max_seq_len:
            starts = np.cumsum(lengths) - lengths
            kept = np.minimum(lengths, self.max_seq_len)
            tokens = np.concatenate([tokens[s : s + k] for s, k in zip(starts.tolist(), kept.tolist())])
            lengths = kept
        return tokens.astype(self.dtype), lengths


_WORKER: _ChunkTokenizer | None = None


def _init_worker(spec: str, dtype: str, max_seq_len: int) -> None:
    global _WORKER
    # A forked worker inherits the parent's loaded tokenizer; a spawned one loads its own.
    if _WORKER is None or (_WORKER.spec, _WORKER.dtype.name, _WORKER.max_seq_len) != (spec, dtype, max_seq_len):
        _WORKER = _ChunkTokenizer(spec, dtype, max_seq_len)


def _run_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return _WORKER(texts)


def _describe_sources(paths: list[Input]) -> list[dict]:
    out = []
    for p in paths:
        if isinstance(p, HFSource):  # its files' sizes and mtimes, and the subset and split read
            out.append(p.describe())
            continue
        st = p.stat()
        out.append({"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


class _ShardWriter:
    """Appends documents to shard_NNNNN.bin.tmp; renames it complete once it holds >= shard_size tokens."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_size: int, shards: list[dict], on_shard_done,
                 masks: bool = False):
        self.folder, self.dtype, self.shard_size = folder, dtype, shard_size
        self.masks = masks  # chat data: a loss mask file beside each shard
        self._mask_file = None
        self.shards = shards  # finished shards (from a resumed run, then ours)
        self.on_shard_done = on_shard_done
        self._file = None
        self._ends: list[int] = []
        self._tokens = 0
        self._max_id = -1

    def _name(self) -> str:
        return f"shard_{len(self.shards):05d}"

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        ends = np.cumsum(lengths)
        first_doc, first_tok = 0, 0
        while first_doc < len(lengths):
            if self._file is None:
                self._file = open(self.folder / f"{self._name()}.bin.tmp", "wb")  # noqa: SIM115 -- closed in _finish
                if self.masks:
                    self._mask_file = open(self.folder / f"{self._name()}.mask.bin.tmp", "wb")  # noqa: SIM115
            rel_ends = ends[first_doc:] - first_tok
            # Whole documents up to the first one that fills the shard.
            take = min(int(np.searchsorted(rel_ends, self.shard_size - self._tokens, side="left")) + 1, len(rel_ends))
            last_tok = first_tok + int(rel_ends[take - 1])
            piece = tokens[first_tok:last_tok]
            self._file.write(piece.tobytes())
            if self._mask_file is not None and mask is not None:
                self._mask_file.write(mask[first_tok:last_tok].astype(np.uint8).tobytes())
            self._ends.extend((self._tokens + rel_ends[:take]).tolist())
            self._tokens += len(piece)
            self._max_id = max(self._max_id, int(piece.max()))
            first_doc, first_tok = first_doc + take, last_tok
            if self._tokens >= self.shard_size:
                self._finish()

    def _finish(self) -> None:
        name = self._name()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        with atomic_path(self.folder / f"{name}.docs.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, np.array(self._ends, dtype=np.int64))
        os.replace(self.folder / f"{name}.bin.tmp", self.folder / f"{name}.bin")
        shard = {"file": f"{name}.bin", "docs": f"{name}.docs.npy", "num_tokens": self._tokens,
                 "num_docs": len(self._ends), "max_token_id": self._max_id}
        if self._mask_file is not None:
            self._mask_file.flush()
            os.fsync(self._mask_file.fileno())
            self._mask_file.close()
            self._mask_file = None
            os.replace(self.folder / f"{name}.mask.bin.tmp", self.folder / f"{name}.mask.bin")
            shard["mask"] = f"{name}.mask.bin"
            shard["mask_checksum"] = content_digest(self.folder / shard["mask"])
        # What the loader verifies at open (datasets.ShardDataset): read back from the disk it was written to.
        shard["checksum"] = shard_checksum(self.folder, shard, self.dtype)
        shard["docs_checksum"] = content_digest(self.folder / shard["docs"])
        self.shards.append(shard)
        self._ends, self._tokens, self._max_id = [], 0, -1
        self.on_shard_done()

    def close(self) -> None:
        if self._file is not None:
            self._finish()

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            (self.folder / f"{self._name()}.bin.tmp").unlink(missing_ok=True)
        if self._mask_file is not None:
            self._mask_file.close()
            self._mask_file = None
            (self.folder / f"{self._name()}.mask.bin.tmp").unlink(missing_ok=True)


class _JsonlWriter:
    """Writes the guide's {"tokens": [...], "length": n} lines to tokens.jsonl.tmp; renamed by close()."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._file = open(folder / f"{TOKENS_JSONL}.tmp", "w", encoding="utf-8")  # noqa: SIM115 -- closed below
        self.num_tokens = 0
        self.max_id = -1
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        start = 0
        for n in lengths.tolist():
            doc = tokens[start : start + n].tolist()
            self._file.write(json.dumps({"tokens": doc, "length": n}, separators=(",", ":")) + "\n")
            self.max_id = max(self.max_id, max(doc))
            self.num_tokens += n
            start += n

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.folder / f"{TOKENS_JSONL}.tmp", self.folder / TOKENS_JSONL)

    def abort(self) -> None:
        self._file.close()
        (self.folder / f"{TOKENS_JSONL}.tmp").unlink(missing_ok=True)


def _check_output(output: Path, settings: dict, sources: list[dict]) -> tuple[str, dict | None]:
    """('new' | 'up_to_date' | 'resume', state); DataError for a folder this run must not touch."""
    if not output.exists():
        return "new", None
    if not output.is_dir():
        raise DataError(f"--output {output} is a file; name a folder (new or empty)")
    if (output / INDEX_FILE).is_file():
        index = read_index(output)
        if index.get("settings") == settings and index.get("sources") == sources:
            return "up_to_date", index
        raise DataError(
            f"--output {output} already holds data prepared from other inputs or settings; "
            "choose a new --output or delete that folder"
        )
    if (output / PROGRESS_FILE).is_file():
        progress = json.loads((output / PROGRESS_FILE).read_text(encoding="utf-8"))
        if progress.get("settings") == settings and progress.get("sources") == sources:
            return "resume", progress
        raise DataError(
            f"--output {output} holds an unfinished run of other inputs or settings (inputs changed since?); "
            "delete that folder or choose a new --output"
        )
    theirs = sorted(p.name for p in output.iterdir())
    if theirs:
        raise DataError(f"--output {output} is not empty and not a prepare-data output (it holds "
                        f"{shown(output, theirs)}); choose a new or empty folder")
    return "new", None


def _chunks(paths: list[Input], text_field: str, doc_sep: str, bad: BadRecords, skip_docs: int,
            position: list[int]):
    """Lists of documents of about CHUNK_CHARS characters; position[0] tracks input bytes consumed."""
    chunk: list[str] = []
    chars = 0
    done_bytes = 0
    for path in paths:
        reader = open_reader(path, text_field, doc_sep, bad)
        for text in reader:
            position[0] = done_bytes + reader.bytes_read
            if skip_docs:
                skip_docs -= 1
                continue
            chunk.append(text)
            chars += len(text)
            if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
                yield chunk
                chunk, chars = [], 0
        done_bytes += reader.size
        position[0] = done_bytes
    if chunk:
        yield chunk


def prepare(inputs: list[str], output: str | Path, tokenizer: str = "byte", workers: int = 1,
            text_field: str = "text", doc_sep: str = "blank", fmt: str = "bin", max_seq_len: int = 0,
            skip_bad_records: bool = False, shard_size: int = 1 << 28, progress: Progress | None = None,
            records: RecordFormat | None = None, chat_template: str = "") -> PrepareResult:
    """Tokenise inputs into output (a folder); idempotent, atomic, resumable. See the module docstring.

    fmt "chat" / "instruction": records rendered with the tokenizer's chat template (or `chat_template`), written as
    bin shards with a loss mask (`records` names their fields; default ones when None)."""
    if fmt not in PREPARE_FORMATS:
        raise DataError(f"--format {fmt} is unknown; use {', '.join(PREPARE_FORMATS)}")
    chat = fmt in ("chat", "instruction")
    rows = COMMAND_OPTIONS["prepare-data"]  # the ranges `titan-npu prepare-data` holds its options to
    for flag, value in (("--workers", workers), ("--shard-size", shard_size), ("--max-seq-len", max_seq_len)):
        rows[flag].check(flag, value)
    output = Path(output).expanduser()
    paths = discover_inputs(inputs)
    local = [p.folder if isinstance(p, HFSource) else p for p in paths]
    _refuse_overlap(output, [Path(i).expanduser() for i in inputs if Path(i).expanduser().exists()]
                    + [p for p in local if p is not None])
    refuse_protected("--output", output, DataError, allow="prepared dataset")  # never into a checkpoint or dataset
    tok: Tokenizer = build_tokenizer(tokenizer)
    if tok.eos_id is None:
        raise DataError(f"tokenizer {tok.name} has no EOS token to separate documents; set eos_token in its config")
    dtype = token_dtype(tok.vocab_size)
    sources = _describe_sources(paths)
    settings = {"tokenizer_fingerprint": tok.fingerprint(), "text_field": text_field, "doc_sep": doc_sep,
                "format": fmt, "max_seq_len": max_seq_len, "shard_size": shard_size if fmt != "jsonl" else 0,
                "skip_bad_records": skip_bad_records}
    template = None
    if chat:
        records = RecordFormat(fmt, *astuple(records)[1:]) if records is not None else RecordFormat(fmt)
        template = load_chat_template(tok, tokenizer, chat_template)
        settings["records"] = asdict(records)
        settings["chat_template_sha256"] = hashlib.sha256(template.text.encode()).hexdigest()
    state, existing = _check_output(output, settings, sources)
    input_bytes = sum(s["size"] for s in sources)
    if state == "up_to_date":
        assert existing is not None
        return PrepareResult(output, True, existing["num_documents"], existing["num_tokens"],
                             len(existing.get("shards", [])), existing.get("bad_records_skipped", 0),
                             input_bytes=input_bytes)
    created = _first_missing(output)  # what to remove again if the input is refused: the output and new parents
    try:
        output.mkdir(parents=True, exist_ok=True)
        for stale in output.glob("*.tmp"):  # leftovers of an interrupted run: never complete
            stale.unlink()
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise os_error(e.filename or output, e, "write") from None
    shards: list[dict] = list(existing["shards"]) if state == "resume" and fmt != "jsonl" else []
    skip_docs = sum(s["num_docs"] for s in shards)

    def save_progress() -> None:
        atomic_write_json(output / PROGRESS_FILE, {"settings": settings, "sources": sources, "shards": shards})

    def leave(kept: int) -> None:
        """Remove what this run wrote; finished shards stay (kept > 0) where a re-run resumes after them."""
        if writer is not None:
            writer.abort()
        if kept:
            return
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)  # bad input: leave nothing behind
        else:
            _remove_ours(output)

    writer = None
    shards_before = len(shards)
    try:
        save_progress()
        writer = _ShardWriter(output, dtype, shard_size, shards, save_progress, masks=chat) if fmt != "jsonl" \
            else _JsonlWriter(output)
        bad = BadRecords(skip=skip_bad_records, hint="fix or remove that record, or pass --skip-bad-records")
        progress = progress or Progress(input_bytes)
        position = [0]
        if template is not None and records is not None:
            _encode_chat_all(paths, records, template, tok, bad, skip_docs, writer, dtype, progress)
        else:
            _tokenize_all(_chunks(paths, text_field, doc_sep, bad, skip_docs, position), writer, tokenizer, tok,
                          dtype, max_seq_len, workers, progress, position)
        writer.close()
    except DataError:
        leave(0)
        raise
    except OSError as e:  # writing the output: no space left, a read-only or vanished folder, an I/O error
        kept = len(shards) - shards_before if fmt != "jsonl" else 0
        leave(kept)
        resume = f"; the {kept} shard(s) finished are kept in {output}: re-run the same command to resume" \
            if kept else ""
        raise os_error(output, e, "write", _write_fix(e) + resume) from None
    except BaseException:
        if writer is not None:
            writer.abort()  # interrupted: finished shards and .progress.json stay for the resume
        raise
    num_docs = sum(s["num_docs"] for s in shards) if fmt != "jsonl" else progress.docs
    if num_docs == 0:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:
            _remove_ours(output)
        raise DataError(f"no documents found in {', '.join(inputs)}; check the inputs and --text-field")
    progress.close()
    num_tokens = sum(s["num_tokens"] for s in shards) if fmt != "jsonl" else writer.num_tokens
    max_id = max(s["max_token_id"] for s in shards) if fmt != "jsonl" else writer.max_id
    index = {
        "format": INDEX_FORMAT, "version": INDEX_VERSION, "kind": fmt, "dtype": dtype.name,
        "num_documents": num_docs, "num_tokens": num_tokens, "max_token_id": max_id,
        "tokenizer": {"spec": tokenizer, "fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id},
        "settings": settings, "sources": sources, "bad_records_skipped": bad.count,
    }
    if fmt != "jsonl":
        index["shards"] = shards
    else:
        index["file"] = TOKENS_JSONL
    try:
        if fmt == "jsonl":
            index["checksum"] = jsonl_checksum(output / TOKENS_JSONL, index)
        atomic_write_json(output / INDEX_FILE, index)
    except OSError as e:
        if fmt == "jsonl":
            leave(0)
        resume = f"; the finished shards are kept in {output}: re-run the same command to finish" \
            if fmt != "jsonl" else ""
        raise os_error(e.filename or output / INDEX_FILE, e, "write", _write_fix(e) + resume) from None
    (output / PROGRESS_FILE).unlink()
    return PrepareResult(output, False, num_docs, num_tokens, len(shards), bad.count, bad.examples,
                         resumed_docs=skip_docs, seconds=progress.elapsed(), input_bytes=input_bytes)


def _write_fix(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there or choose an --output on another disk"
    if e.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
        return "choose an --output you can write to"
    return fix_for(e.errno)


def _refuse_overlap(output: Path, inputs: list[Path]) -> None:
    """DataError when the output folder is, holds or lies inside an input: writing it would change the corpus."""
    out = output.resolve()
    for path in inputs:
        src = path.resolve()
        relation = "is" if out == src else "holds" if out in src.parents else "lies inside" if src in out.parents \
            else None
        if relation is not None:
            raise DataError(f"--output {output} {relation} the input {path}; write to a folder outside the inputs")


def _first_missing(path: Path) -> Path | None:
    """The outermost of path and its parents that does not exist yet (None if path exists)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _remove_ours(folder: Path) -> None:
    for pattern in ("shard_*.bin", "shard_*.docs.npy", "shard_*.mask.bin", "*.tmp", PROGRESS_FILE, TOKENS_JSONL):
        for p in folder.glob(pattern):
            p.unlink()


def _tokenize_all(chunks, writer, spec: str, tokenizer: Tokenizer, dtype: np.dtype, max_seq_len: int, workers: int,
                  progress: Progress, position: list[int]) -> None:
    """Tokenise chunks (in order) in worker processes with bounded look-ahead, feeding writer."""
    global _WORKER
    worker = _WORKER = _ChunkTokenizer(spec, dtype.name, max_seq_len, tokenizer)
    if workers == 1:
        for chunk in chunks:
            tokens, lengths = worker(chunk)
            writer.add(tokens, lengths)
            progress.update(len(lengths), len(tokens), position[0])
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec, dtype.name, max_seq_len)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((pool.apply_async(_run_worker, (chunk,)), position[0]))
            if len(pending) >= 2 * workers:  # look-ahead bound keeps memory flat on any corpus size
                _drain_one(pending, writer, progress)
        while pending:
            _drain_one(pending, writer, progress)


def _encode_chat_all(paths: list[Input], records: RecordFormat, template: ChatTemplate, tokenizer: Tokenizer,
                     bad: BadRecords, skip_docs: int, writer: _ShardWriter, dtype: np.dtype, progress: Progress,
                     ) -> None:
    """Chat records -> (ids, assistant mask) per conversation, in order, into the shard writer; the first skip_docs
    conversations were written by the run this one resumes."""
    if any(isinstance(p, HFSource) for p in paths):
        raise DataError("chat records are read from .jsonl / .json files; export the Hugging Face dataset to JSON "
                        "Lines first")
    ids: list[int] = []
    lengths: list[int] = []
    masks: list[np.ndarray] = []

    def flush() -> None:
        if lengths:
            writer.add(np.asarray(ids, dtype=dtype), np.asarray(lengths, np.int64), np.concatenate(masks))
            progress.update(len(lengths), len(ids), progress.bytes)  # records are rendered one by one: no byte count
            ids.clear()
            lengths.clear()
            masks.clear()

    for doc, mask in encode_records(paths, records, template, tokenizer, bad):  # type: ignore[arg-type]
        if skip_docs:
            skip_docs -= 1
            continue
        ids.extend(doc)
        lengths.append(len(doc))
        masks.append(mask)
        if len(lengths) >= CHUNK_DOCS:
            flush()
    flush()


def _drain_one(pending: deque, writer, progress: Progress) -> None:
    result, bytes_done = pending.popleft()
    tokens, lengths = result.get()
    writer.add(tokens, lengths)
    progress.update(len(lengths), len(tokens), bytes_done)

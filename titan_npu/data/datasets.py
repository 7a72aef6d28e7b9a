"""Token datasets: prepared binary shards (mmap), tokens JSONL (offset index), raw text tokenised on the fly.

Every dataset is a list of documents whose tokens already end with EOS, so packing is plain concatenation.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import numpy as np

from titan_npu.atomic import atomic_path
from titan_npu.data.chat import ChatSource, encode_records
from titan_npu.data.files import (
    DIGEST_SCHEME,
    content_digest,
    not_regular,
    open_input,
    os_error,
    read_bytes,
    regular_stat,
    sampled_blocks,
    warn_once,
)
from titan_npu.data.hf_datasets import hf_source
from titan_npu.data.sources import (
    BadRecords,
    Input,
    builtin_chat_path,
    builtin_corpus_path,
    discover_inputs,
    input_size,
    iter_documents,
    missing_input,
    source_kind,
)
from titan_npu.data.tokenizer import Tokenizer
from titan_npu.errors import DataError
from titan_npu.outputs import PREPARED_FORMAT

INDEX_FILE = "index.json"
PROGRESS_FILE = ".progress.json"
TOKENS_JSONL = "tokens.jsonl"
INDEX_FORMAT = PREPARED_FORMAT
INDEX_VERSION = 2  # 2: a checksum per shard (shard_checksum) and of tokens.jsonl; 1: sizes only
RAW_LIMIT_BYTES = 1 << 30  # raw text above this is tokenised once with prepare-data, not at every start
_JSONL_INDEX_SUFFIX = ".titan-index.npz"
_MAX_ID = 1 << 31  # no vocabulary comes near; larger numbers in a tokens JSONL are not token ids


class TokenDataset:
    """Documents of token ids; doc_lengths[i] tokens each (EOS included)."""

    description: str
    doc_lengths: np.ndarray
    max_token_id: int
    max_token_where: str = ""  # the file (and line) holding max_token_id, for messages
    tokenizer_fingerprint: str | None = None
    tokenizer_spec: str | None = None  # the --tokenizer prepare-data was given, for messages
    has_mask: bool = False  # chat data: a loss mask per token (1 = an assistant token), read with read_mask

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_lengths.sum())

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """Tokens lo:hi of document doc."""
        raise NotImplementedError

    def read_mask(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """The loss mask of tokens lo:hi of document doc (chat data only: has_mask)."""
        raise DataError(f"{self.description} holds no loss mask (text, not chat data); set data.format = \"text\" "
                        "or prepare it with prepare-data --format chat")

    def where(self, doc: int) -> str:
        """The file that holds document doc, for messages."""
        return self.description

    def write_caches(self) -> None:
        """Write what makes the next start faster beside the data; called only once the input is validated, so a
        refused run leaves the user's data folder as it was."""


class InMemoryDataset(TokenDataset):
    """Documents held in one array: raw text tokenised at start-up (small corpora)."""

    def __init__(self, tokens: np.ndarray, doc_lengths: np.ndarray, description: str,
                 mask: np.ndarray | None = None):
        self.tokens = tokens
        self.mask = mask
        self.has_mask = mask is not None
        self.doc_lengths = doc_lengths.astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(self.doc_lengths)[:-1]]).astype(np.int64)
        self.max_token_id = int(tokens.max()) if len(tokens) else -1
        self.description = description

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        start = self.doc_starts[doc]
        return self.tokens[start + lo : start + hi]

    def read_mask(self, doc: int, lo: int, hi: int) -> np.ndarray:
        if self.mask is None:
            return super().read_mask(doc, lo, hi)
        start = self.doc_starts[doc]
        return self.mask[start + lo : start + hi]


_REPREPARE = "re-run titan-npu prepare-data into a new --output"


def shard_checksum(folder: Path, shard: dict, dtype: np.dtype) -> str:
    """The checksum of one shard: its tokens (whole, or sampled when large: files.py) and its entry in index.json."""
    entry = {k: shard[k] for k in ("file", "docs", "num_tokens", "num_docs", "max_token_id")}
    entry["dtype"] = np.dtype(dtype).name
    return content_digest(folder / shard["file"], json.dumps(entry, sort_keys=True).encode())


def jsonl_checksum(path: Path, index: dict) -> str:
    """The checksum of a prepared tokens.jsonl: its bytes (whole, or sampled when large) and the index's counts."""
    entry = {k: index[k] for k in ("num_documents", "num_tokens", "max_token_id")}
    return content_digest(path, json.dumps(entry, sort_keys=True).encode())


def _load_ends(path: Path, num_docs: int, num_tokens: int, checksum: str | None) -> np.ndarray:
    """shard_NNNNN.docs.npy: the documents' end offsets, checked against the index (never unpickled)."""
    if checksum is not None and content_digest(path) != checksum:
        raise DataError(f"{path} does not match its checksum in {INDEX_FILE} (rewritten, damaged or from another "
                        f"run); {_REPREPARE}")
    data = read_bytes(path, f"{_REPREPARE}")
    try:
        ends = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:  # truncated, not .npy, an object array
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path} is not a valid document index ({why}); {_REPREPARE}") from None
    if ends.ndim != 1 or ends.dtype.kind not in "iu":
        raise DataError(f"{path} holds a {ends.dtype} array of shape {ends.shape}, not the documents' end offsets; "
                        f"{_REPREPARE}")
    ends = ends.astype(np.int64)
    if len(ends) != num_docs or (len(ends) and (ends[-1] != num_tokens or ends[0] <= 0 or np.any(np.diff(ends) <= 0))):
        raise DataError(f"{path} disagrees with {INDEX_FILE}; {_REPREPARE}")
    return ends


class ShardDataset(TokenDataset):
    """prepare-data output: shard_*.bin (uint16/uint32) memory-mapped, document ends in shard_*.docs.npy.

    Opening checks the folder against index.json by content, at a bounded cost: the shards listed and no others,
    each of the size its entry says, its checksum (files.content_digest: whole when small, sampled blocks when large)
    and its document index; the maxima the index states agree with its shards' entries, which the checksums cover.
    A folder prepared before the checksums (index version 1) is read with the size checks and a warning line.
    """

    def __init__(self, folder: Path, index: dict):
        self.folder = folder
        self.description = str(folder)
        try:
            self.dtype = np.dtype(index["dtype"])
            self.max_token_id = int(index["max_token_id"])
            self.tokenizer_fingerprint = index["tokenizer"]["fingerprint"]
            self.tokenizer_spec = index["tokenizer"].get("spec")
            vocab = int(index["tokenizer"]["vocab_size"])
            shards = list(index["shards"])
            for shard in shards:
                for key in ("file", "docs", "num_tokens", "num_docs", "max_token_id"):
                    shard[key]  # noqa: B018 -- a KeyError names the missing key
            version = int(index.get("version", 1))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DataError(f"{folder / INDEX_FILE} is damaged or edited ({type(e).__name__}: {e}); "
                            f"{_REPREPARE}") from None
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise DataError(f"{folder / INDEX_FILE} names dtype {self.dtype}, not uint16 or uint32; {_REPREPARE}")
        self.shard_files = [s["file"] for s in shards]
        self.mask_files = [s.get("mask") for s in shards]
        self.has_mask = bool(shards) and all(self.mask_files)
        if any(self.mask_files) and not self.has_mask:
            raise DataError(f"{folder / INDEX_FILE} lists a loss mask for some shards only (edited?); {_REPREPARE}")
        self._check_folder(shards, vocab)
        checked = version >= 2 and all("checksum" in s for s in shards)
        if not checked:
            warn_once(f"{folder} was prepared before shard checksums ({INDEX_FILE} version {version}): its shards "
                      f"are checked by size only; {_REPREPARE} to have them checked by content")
        if shards:
            top = max(shards, key=lambda s: s["max_token_id"])
            self.max_token_where = str(folder / top["file"])
        lengths, shard_of, starts = [], [], []
        for s_i, shard in enumerate(shards):
            path = folder / shard["file"]
            expected = int(shard["num_tokens"]) * self.dtype.itemsize
            if not os.path.lexists(path):
                raise DataError(f"shard {path} is missing but {INDEX_FILE} lists it (deleted or not copied?); "
                                f"{_REPREPARE}")
            actual = regular_stat(path, _REPREPARE).st_size
            if actual != expected:
                raise DataError(
                    f"shard {path} is {actual} bytes but {INDEX_FILE} says {expected} bytes (truncated or replaced); "
                    f"{_REPREPARE}"
                )
            if checked and shard_checksum(folder, shard, self.dtype) != shard["checksum"]:
                raise DataError(f"shard {path} does not match its entry in {INDEX_FILE} (rewritten, damaged or "
                                f"edited: its tokens, size or max token id); {_REPREPARE}")
            if not checked:  # no checksum: at least a bounded sample of its ids against the entry's maximum
                sample = np.frombuffer(sampled_blocks(path, self.dtype.itemsize), dtype=self.dtype)
                if len(sample) and int(sample.max()) > int(shard["max_token_id"]):
                    raise DataError(f"shard {path} holds token id {int(sample.max())} but {INDEX_FILE} says its "
                                    f"largest is {shard['max_token_id']} (rewritten or edited); {_REPREPARE}")
            ends = _load_ends(folder / shard["docs"], int(shard["num_docs"]), int(shard["num_tokens"]),
                              shard.get("docs_checksum") if checked else None)
            if self.has_mask:
                _check_mask(folder / shard["mask"], int(shard["num_tokens"]), shard.get("mask_checksum"))
            begins = np.concatenate([[0], ends[:-1]])
            lengths.append(ends - begins)
            starts.append(begins)
            shard_of.append(np.full(len(ends), s_i, dtype=np.int32))
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.doc_shard = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.doc_begin = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self._maps: dict[int, np.memmap] = {}
        self._mask_maps: dict[int, np.memmap] = {}

    def _check_folder(self, shards: list[dict], vocab: int) -> None:
        """The shard files on disk are the ones the index lists; its maxima agree with its shards' entries."""
        index = self.folder / INDEX_FILE
        listed = {s["file"] for s in shards} | {s["docs"] for s in shards}
        listed |= {s["mask"] for s in shards if s.get("mask")}
        try:
            on_disk = {p.name for p in self.folder.iterdir() if p.name.startswith("shard_")
                       and (p.name.endswith(".bin") or p.name.endswith(".docs.npy"))}
        except OSError as e:
            raise os_error(self.folder, e, "list the folder") from None
        extra = sorted(on_disk - listed)
        if extra:
            raise DataError(f"{self.folder / extra[0]} is not listed in {index} ({len(extra)} such file(s): left from "
                            f"another run or copied in?); {_REPREPARE}")
        top = max((int(s["max_token_id"]) for s in shards), default=-1)
        if top != self.max_token_id:
            raise DataError(f"{index} says max_token_id {self.max_token_id} but its shards' entries say {top} "
                            f"(edited?); {_REPREPARE}")
        if self.max_token_id >= vocab:
            raise DataError(f"{index} says its tokens go up to id {self.max_token_id}, beyond its tokenizer's "
                            f"vocab_size {vocab} (edited, or shards from another tokenizer); {_REPREPARE}")

    def __getstate__(self) -> dict:
        # Each worker process maps the files itself; pickling a memmap would copy the data.
        state = dict(self.__dict__)
        state["_maps"], state["_mask_maps"] = {}, {}
        return state

    def where(self, doc: int) -> str:
        return str(self.folder / self.shard_files[int(self.doc_shard[doc])])

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        s = int(self.doc_shard[doc])
        shard = self._maps.get(s)
        if shard is None:
            path = self.folder / self.shard_files[s]
            try:
                with open_input(path, _REPREPARE) as f:
                    shard = self._maps[s] = np.memmap(f, dtype=self.dtype, mode="r")
            except OSError as e:  # found unreadable mid-run
                raise os_error(path, e) from None
        begin = self.doc_begin[doc]
        return shard[begin + lo : begin + hi]

    def read_mask(self, doc: int, lo: int, hi: int) -> np.ndarray:
        if not self.has_mask:
            return super().read_mask(doc, lo, hi)
        s = int(self.doc_shard[doc])
        mask = self._mask_maps.get(s)
        if mask is None:
            path = self.folder / str(self.mask_files[s])
            try:
                with open_input(path, _REPREPARE) as f:
                    mask = self._mask_maps[s] = np.memmap(f, dtype=np.uint8, mode="r")
            except OSError as e:
                raise os_error(path, e) from None
        begin = self.doc_begin[doc]
        return mask[begin + lo : begin + hi]


def _check_mask(path: Path, num_tokens: int, checksum: str | None) -> None:
    """shard_NNNNN.mask.bin: one byte per token, matching its checksum in the index."""
    if not os.path.lexists(path):
        raise DataError(f"loss mask {path} is missing but {INDEX_FILE} lists it; {_REPREPARE}")
    size = regular_stat(path, _REPREPARE).st_size
    if size != num_tokens:
        raise DataError(f"loss mask {path} is {size} bytes but its shard holds {num_tokens} tokens; {_REPREPARE}")
    if checksum is None or content_digest(path) != checksum:
        raise DataError(f"loss mask {path} does not match its checksum in {INDEX_FILE} (rewritten, damaged or "
                        f"edited); {_REPREPARE}")


class TokensJsonlDataset(TokenDataset):
    """The guide's {"tokens": [...], "length": n} per line, read by byte offset; EOS appended where missing."""

    def __init__(self, path: Path, eos_id: int | None, fingerprint: str | None = None, spec: str | None = None):
        self.path = path
        self.description = str(path)
        self.eos_id = eos_id
        self.tokenizer_fingerprint = fingerprint
        self.tokenizer_spec = spec
        (self.offsets, raw_lengths, last, self.max_token_id, max_line), self._unsaved_index = _jsonl_index(path)
        self.max_token_where = f"{path}:{max_line}"
        self.append_eos = (last != eos_id) if eos_id is not None else np.zeros(len(last), dtype=bool)
        self.doc_lengths = raw_lengths + self.append_eos
        if eos_id is not None:
            self.max_token_id = max(self.max_token_id, eos_id)
        self._file = None
        self._cached: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_file"], state["_cached"], state["_unsaved_index"] = None, None, None
        return state

    def write_caches(self) -> None:
        if self._unsaved_index is not None:
            _save_jsonl_index(*self._unsaved_index)
            self._unsaved_index = None

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != doc:
            if self._file is None:
                self._file = open_input(self.path)  # kept open for the life of the dataset
            try:
                self._file.seek(int(self.offsets[doc]))
                line = self._file.readline()
            except OSError as e:  # found unreadable mid-run
                raise os_error(self.path, e) from None
            try:
                tokens = json.loads(line)["tokens"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{self.path} changed since it was opened (no token record at byte "
                                f"{int(self.offsets[doc])}); restart the run") from None
            if self.append_eos[doc]:
                tokens.append(self.eos_id)
            self._cached = (doc, np.asarray(tokens, dtype=np.int64))
        return self._cached[1][lo:hi]


def _jsonl_index(path: Path) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, int, int], tuple | None]:
    """(byte offset, token count, last token) per line, the max id and its line; read from the cache beside the file
    when it is current, else computed and returned with the arguments of _save_jsonl_index (None when cached).

    The cache is current when its key matches the file's: size, mtime and ctime (any write or utime changes ctime)
    and a digest of its content (files.content_digest: whole when small, sampled when large), so a file rewritten
    with its size and mtime kept, or a cache copied beside another file, is rebuilt rather than trusted.
    """
    with open_input(path) as f:
        st = os.fstat(f.fileno())
    cache = path.with_name(path.name + _JSONL_INDEX_SUFFIX)
    key = np.array([st.st_size, st.st_mtime_ns, st.st_ctime_ns], dtype=np.int64)
    digest = content_digest(path)
    if os.path.isfile(cache):
        try:
            with open_input(cache) as raw, np.load(raw, allow_pickle=False) as z:
                if np.array_equal(z["key"], key) and str(z["digest"]) == digest and str(z["scheme"]) == DIGEST_SCHEME:
                    cached = (z["offsets"], z["lengths"], z["last"], int(z["max_id"]), int(z["max_line"]))
                    if _plausible(cached, st.st_size):
                        return cached, None
        except (OSError, ValueError, KeyError, DataError, EOFError):
            pass  # stale or damaged cache: rebuild it
    offsets, lengths, last = [], [], []
    max_id, max_line = -1, 0
    with open_input(path) as f:
        offset = 0
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    tokens = _parse_tokens_line(line, f"{path}:{lineno}")
                    offsets.append(offset)
                    lengths.append(len(tokens))
                    last.append(tokens[-1])
                    if max(tokens) > max_id:
                        max_id, max_line = max(tokens), lineno
                offset += len(line)
        except OSError as e:
            raise os_error(path, e) from None
    if not offsets:
        raise DataError(f"{path} holds no token records; check the file")
    result = (np.array(offsets, np.int64), np.array(lengths, np.int64), np.array(last, np.int64), max_id, max_line)
    return result, (cache, key, digest, result)


def _plausible(index: tuple, size: int) -> bool:
    """A cached offset index that could be the file's: one entry per record, offsets rising inside the file."""
    offsets, lengths, last, max_id, _ = index
    n = len(offsets)
    return (n > 0 and offsets.ndim == 1 and len(lengths) == n and len(last) == n and offsets.dtype.kind == "i"
            and bool(np.all(np.diff(offsets) > 0)) and 0 <= int(offsets[0]) and int(offsets[-1]) < size
            and bool(np.all(lengths > 0)) and int(last.max()) <= max_id)


def _save_jsonl_index(cache: Path, key: np.ndarray, digest: str, result: tuple) -> None:
    try:
        with atomic_path(cache) as tmp, open(tmp, "wb") as out:
            np.savez(out, key=key, digest=np.array(digest), scheme=np.array(DIGEST_SCHEME), offsets=result[0],
                     lengths=result[1], last=result[2], max_id=np.int64(result[3]), max_line=np.int64(result[4]))
    except OSError:
        pass  # a read-only data folder only costs a rebuild next time


def _parse_tokens_line(line: bytes, where: str) -> list[int]:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: malformed JSON ({e.args[0].split(':')[0]}); fix or remove the line") from None
    tokens = record.get("tokens") if isinstance(record, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int and 0 <= t < _MAX_ID for t in tokens):
        raise DataError(f"{where}: 'tokens' must be a non-empty list of non-negative ints (token ids below 2**31); "
                        "fix or remove the line")
    if "length" in record and record["length"] != len(tokens):
        raise DataError(
            f"{where}: 'length' is {record['length']} but 'tokens' has {len(tokens)}; fix the line"
        )
    return tokens


def read_index(folder: Path) -> dict:
    """index.json of a prepare-data output folder."""
    path = folder / INDEX_FILE
    try:
        index = json.loads(read_bytes(path, _REPREPARE).decode("utf-8"))
    except ValueError as e:
        raise DataError(f"{path} cannot be read ({e}); re-run titan-npu prepare-data into a new --output") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise DataError(f"{path} is not a titan-npu prepare-data index; point data.path at a prepare-data output")
    return index


def tokenize_documents(texts: list[str], tokenizer: Tokenizer, description: str) -> InMemoryDataset:
    """Documents -> BOS + tokens + EOS each, in one array."""
    if tokenizer.eos_id is None:
        raise DataError(
            f"tokenizer {tokenizer.name} has no EOS token to separate documents; set eos_token in tokenizer_config.json"
        )
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    pieces = [tokenizer.encode_flat(texts[i : i + 4096], bos=True, eos=True) for i in range(0, len(texts), 4096)]
    tokens = np.concatenate([t.astype(dtype) for t, _ in pieces]) if pieces else np.zeros(0, dtype)
    lengths = np.concatenate([n for _, n in pieces]) if pieces else np.zeros(0, np.int64)
    return InMemoryDataset(tokens, lengths, description)


def _raw_dataset(paths: list[Input], tokenizer: Tokenizer | None, text_field: str, description: str
                 ) -> InMemoryDataset:
    if tokenizer is None:
        raise DataError(f"{description} is raw text and needs a tokenizer; set data.tokenizer")
    size = sum(input_size(p) for p in paths)
    if size > RAW_LIMIT_BYTES:
        raise DataError(
            f"{description} is {size / 2**20:.0f} MiB of raw text, too much to tokenise at every start; "
            "run titan-npu prepare-data and point data.path at its output"
        )
    bad = BadRecords(hint="fix or remove that record, or clean the corpus with prepare-data --skip-bad-records")
    texts = list(iter_documents(paths, text_field=text_field, bad=bad))
    if not texts:
        raise DataError(f"{description} holds no documents; check the path and data.text_field")
    return tokenize_documents(texts, tokenizer, description)


def _chat_dataset(paths: list[Input], tokenizer: Tokenizer | None, chat: ChatSource, description: str
                  ) -> InMemoryDataset:
    """Chat or instruction records -> each conversation's ids and assistant mask, rendered with the chat template."""
    if tokenizer is None:
        raise DataError(f"{description} is chat data and needs a tokenizer; set data.tokenizer")
    hf = [p for p in paths if not isinstance(p, Path)]
    if hf:
        raise DataError(f"{hf[0]}: chat records are read from .jsonl / .json files; export the dataset to JSON Lines")
    size = sum(input_size(p) for p in paths)
    if size > RAW_LIMIT_BYTES:
        raise DataError(f"{description} is {size / 2**20:.0f} MiB of chat records, too much to render at every start; "
                        "run titan-npu prepare-data --format chat and point data.path at its output")
    bad = BadRecords(skip=chat.skip_bad_records,
                     hint="fix or remove that record, or set data.skip_bad_records = true to count and skip such")
    ids: list[int] = []
    lengths: list[int] = []
    masks: list[np.ndarray] = []
    for doc, mask in encode_records(paths, chat.fmt, chat.template, tokenizer, bad):  # type: ignore[arg-type]
        ids.extend(doc)
        lengths.append(len(doc))
        masks.append(mask)
    if bad.count:
        warn_once(f"{description}: skipped {bad.count} bad record(s) (data.skip_bad_records); first: "
                  + " | ".join(bad.examples))
    if not lengths:
        raise DataError(f"{description} holds no conversations; check data.path and data.format = {chat.fmt.kind!r}")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    return InMemoryDataset(np.asarray(ids, dtype=dtype), np.asarray(lengths, np.int64), description,
                           mask=np.concatenate(masks))


def _first_record(path: Path) -> object:
    with open_input(path) as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def open_dataset(path: str, tokenizer: Tokenizer | None, text_field: str = "text", subset: str = "",
                 split: str = "", chat: ChatSource | None = None) -> TokenDataset:
    """The dataset data.path names: '' = built-in corpus, a prepare-data folder, a tokens JSONL, raw text, or a
    Hugging Face dataset on disk (hf://name or a save_to_disk folder; subset/split for those only: hf_datasets.py).
    With `chat` (data.format chat / instruction) raw files are read as conversations, and a prepared folder must
    hold a loss mask (prepare-data --format chat)."""
    ds = _open_dataset(path, tokenizer, text_field, subset, split, chat)
    if chat is not None and not ds.has_mask:
        raise DataError(f"data.format is {chat.fmt.kind!r} but {ds.description} is token data without a loss mask; "
                        "prepare it with prepare-data --format chat (or instruction), or set data.format = \"text\"")
    return ds


def _open_dataset(path: str, tokenizer: Tokenizer | None, text_field: str, subset: str, split: str,
                  chat: ChatSource | None) -> TokenDataset:
    if not path and chat is not None:
        if chat.fmt.kind != "chat":
            raise DataError(f"data.format = {chat.fmt.kind!r} needs data.path: a .jsonl / .json file (or folder) of "
                            "records, or a prepare-data --format instruction output")
        return _chat_dataset([builtin_chat_path()], tokenizer, chat, "built-in toy chat corpus")
    if not path:
        return _raw_dataset([builtin_corpus_path()], tokenizer, "text", "built-in corpus (Python docs)")
    hf = hf_source(path, subset, split)
    if hf is not None and chat is not None:
        raise DataError(f"{path}: chat records are read from .jsonl / .json files; export the dataset to JSON Lines")
    if hf is not None:  # its documents are tokenised like a raw .jsonl's (prepare-data makes shards of it)
        return _raw_dataset([hf], tokenizer, text_field, path)
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        if os.path.lexists(p):
            raise missing_input(p, path, "data path") from None
        raise DataError(f"data path {path} does not exist; set data.path to a file or folder (or '' for the built-in)"
                        ) from None
    except OSError as e:
        raise os_error(p, e, "look at") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise not_regular(path, mode, "set data.path to a regular file or a folder (copy a stream into a file first)")
    eos = tokenizer.eos_id if tokenizer is not None else None
    if stat.S_ISDIR(mode):
        if os.path.lexists(p / INDEX_FILE):
            index = read_index(p)
            if index.get("kind") == "jsonl":
                return _prepared_jsonl(p, index)
            return ShardDataset(p, index)
        if os.path.lexists(p / PROGRESS_FILE):
            raise DataError(f"{path} is an unfinished prepare-data output; re-run the same prepare-data to finish it")
        if chat is not None:
            return _chat_dataset(discover_inputs([str(p)]), tokenizer, chat, str(p))
        return _raw_dataset(discover_inputs([str(p)]), tokenizer, text_field, str(p))
    if chat is not None:
        return _chat_dataset([p], tokenizer, chat, str(p))
    kind = source_kind(p)
    if kind == "jsonl":
        record = _first_record(p) if p.suffix == ".jsonl" else None
        if isinstance(record, dict) and "tokens" in record:
            return TokensJsonlDataset(p, eos)
    return _raw_dataset([p], tokenizer, text_field, str(p))


def _prepared_jsonl(folder: Path, index: dict) -> TokensJsonlDataset:
    """A prepare-data --format jsonl output, its tokens.jsonl checked against the index's checksum when it has one."""
    path = folder / TOKENS_JSONL
    try:
        tok = index["tokenizer"]
        expected = index.get("checksum")
        actual = jsonl_checksum(path, index) if expected is not None and os.path.lexists(path) else expected
    except (KeyError, TypeError) as e:
        raise DataError(f"{folder / INDEX_FILE} is damaged or edited ({type(e).__name__}: {e}); {_REPREPARE}") from None
    if not os.path.lexists(path):
        raise DataError(f"{path} is missing but {folder / INDEX_FILE} names it; {_REPREPARE}")
    if expected is None:
        warn_once(f"{folder} was prepared before checksums ({INDEX_FILE} version {index.get('version', 1)}): "
                  f"{TOKENS_JSONL} is not checked against it; {_REPREPARE} to have it checked by content")
    elif actual != expected:
        raise DataError(f"{path} does not match its checksum in {INDEX_FILE} (rewritten, damaged or edited); "
                        f"{_REPREPARE}")
    ds = TokensJsonlDataset(path, tok["eos_id"], tok["fingerprint"], tok.get("spec"))
    vocab = tok.get("vocab_size")
    if isinstance(vocab, int) and ds.max_token_id >= vocab:
        raise DataError(f"{ds.max_token_where} holds token id {ds.max_token_id}, beyond the tokenizer's vocab_size "
                        f"{vocab} in {folder / INDEX_FILE}; {_REPREPARE}")
    return ds


def verify_dataset(ds: TokenDataset, tokenizer: Tokenizer | None, model_vocab_size: int | None) -> None:
    """DataError when the data was made by another tokenizer or holds ids the model has no embedding for."""
    if tokenizer is not None and ds.tokenizer_fingerprint and ds.tokenizer_fingerprint != tokenizer.fingerprint():
        given = f" (prepare-data was given {ds.tokenizer_spec}: --data.tokenizer {ds.tokenizer_spec})" \
            if ds.tokenizer_spec else ""
        raise DataError(
            f"{ds.description} was tokenised with a different tokenizer (fingerprint {ds.tokenizer_fingerprint}) than "
            f"data.tokenizer {tokenizer.name} ({tokenizer.fingerprint()}); use the same tokenizer{given} or re-run "
            "prepare-data"
        )
    if model_vocab_size is not None and ds.max_token_id >= model_vocab_size:
        raise DataError(
            f"{ds.max_token_where or ds.description} holds token id {ds.max_token_id} but model.vocab_size is "
            f"{model_vocab_size}; "
            f"set model.vocab_size > {ds.max_token_id} or re-tokenise the data"
        )

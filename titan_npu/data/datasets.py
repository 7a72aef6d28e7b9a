"""Token datasets: prepared binary shards (mmap), tokens JSONL (offset index), raw text tokenised on the fly.

Every dataset is a list of documents whose tokens already end with EOS, so packing is plain concatenation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from titan_npu.atomic import atomic_path
from titan_npu.data.sources import (
    PREPARED_FORMAT,
    BadRecords,
    builtin_corpus_path,
    discover_inputs,
    iter_documents,
    source_kind,
)
from titan_npu.data.tokenizer import Tokenizer
from titan_npu.errors import DataError

INDEX_FILE = "index.json"
PROGRESS_FILE = ".progress.json"
TOKENS_JSONL = "tokens.jsonl"
INDEX_FORMAT = PREPARED_FORMAT
RAW_LIMIT_BYTES = 1 << 30  # raw text above this is tokenised once with prepare-data, not at every start
_JSONL_INDEX_SUFFIX = ".titan-index.npz"


class TokenDataset:
    """Documents of token ids; doc_lengths[i] tokens each (EOS included)."""

    description: str
    doc_lengths: np.ndarray
    max_token_id: int
    max_token_where: str = ""  # the file (and line) holding max_token_id, for messages
    tokenizer_fingerprint: str | None = None
    tokenizer_spec: str | None = None  # the --tokenizer prepare-data was given, for messages

    @property
    def num_docs(self) -> int:
        return len(self.doc_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_lengths.sum())

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """Tokens lo:hi of document doc."""
        raise NotImplementedError

    def write_caches(self) -> None:
        """Write what makes the next start faster beside the data; called only once the input is validated, so a
        refused run leaves the user's data folder as it was."""


class InMemoryDataset(TokenDataset):
    """Documents held in one array: raw text tokenised at start-up (small corpora)."""

    def __init__(self, tokens: np.ndarray, doc_lengths: np.ndarray, description: str):
        self.tokens = tokens
        self.doc_lengths = doc_lengths.astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(self.doc_lengths)[:-1]]).astype(np.int64)
        self.max_token_id = int(tokens.max()) if len(tokens) else -1
        self.description = description

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        start = self.doc_starts[doc]
        return self.tokens[start + lo : start + hi]


class ShardDataset(TokenDataset):
    """prepare-data output: shard_*.bin (uint16/uint32) memory-mapped, document ends in shard_*.docs.npy."""

    def __init__(self, folder: Path, index: dict):
        self.folder = folder
        self.description = str(folder)
        self.dtype = np.dtype(index["dtype"])
        self.max_token_id = int(index["max_token_id"])
        self.tokenizer_fingerprint = index["tokenizer"]["fingerprint"]
        self.tokenizer_spec = index["tokenizer"].get("spec")
        self.shard_files = [s["file"] for s in index["shards"]]
        if index["shards"]:
            top = max(index["shards"], key=lambda s: s["max_token_id"])
            self.max_token_where = str(folder / top["file"])
        lengths, shard_of, starts = [], [], []
        for s_i, shard in enumerate(index["shards"]):
            path = folder / shard["file"]
            expected = int(shard["num_tokens"]) * self.dtype.itemsize
            actual = path.stat().st_size if path.is_file() else -1
            if actual != expected:
                found = "missing" if actual < 0 else f"{actual} bytes"
                raise DataError(
                    f"shard {path} is {found} but {INDEX_FILE} says {expected} bytes (truncated or replaced); "
                    "re-run titan-npu prepare-data into a new --output"
                )
            ends = np.load(folder / shard["docs"], allow_pickle=False).astype(np.int64)
            if len(ends) != int(shard["num_docs"]) or (len(ends) and ends[-1] != int(shard["num_tokens"])):
                raise DataError(f"{folder / shard['docs']} disagrees with {INDEX_FILE}; re-run titan-npu prepare-data")
            begins = np.concatenate([[0], ends[:-1]])
            lengths.append(ends - begins)
            starts.append(begins)
            shard_of.append(np.full(len(ends), s_i, dtype=np.int32))
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.doc_shard = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.doc_begin = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self._maps: dict[int, np.memmap] = {}

    def __getstate__(self) -> dict:
        # Each worker process maps the files itself; pickling a memmap would copy the data.
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def read(self, doc: int, lo: int, hi: int) -> np.ndarray:
        s = int(self.doc_shard[doc])
        shard = self._maps.get(s)
        if shard is None:
            shard = self._maps[s] = np.memmap(self.folder / self.shard_files[s], dtype=self.dtype, mode="r")
        begin = self.doc_begin[doc]
        return shard[begin + lo : begin + hi]


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
                self._file = open(self.path, "rb")  # noqa: SIM115 -- kept open for the life of the dataset
            self._file.seek(int(self.offsets[doc]))
            tokens = json.loads(self._file.readline())["tokens"]
            if self.append_eos[doc]:
                tokens.append(self.eos_id)
            self._cached = (doc, np.asarray(tokens, dtype=np.int64))
        return self._cached[1][lo:hi]


def _jsonl_index(path: Path) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, int, int], tuple | None]:
    """(byte offset, token count, last token) per line, the max id and its line; read from the cache beside the file
    when it is current, else computed and returned with the arguments of _save_jsonl_index (None when cached)."""
    stat = path.stat()
    cache = path.with_name(path.name + _JSONL_INDEX_SUFFIX)
    key = np.array([stat.st_size, stat.st_mtime_ns], dtype=np.int64)
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as z:
                if np.array_equal(z["key"], key):
                    return (z["offsets"], z["lengths"], z["last"], int(z["max_id"]), int(z["max_line"])), None
        except (OSError, ValueError, KeyError):
            pass  # stale or damaged cache: rebuild it
    offsets, lengths, last = [], [], []
    max_id, max_line = -1, 0
    with open(path, "rb") as f:
        offset = 0
        for lineno, line in enumerate(f, 1):
            if line.strip():
                tokens = _parse_tokens_line(line, f"{path}:{lineno}")
                offsets.append(offset)
                lengths.append(len(tokens))
                last.append(tokens[-1])
                if max(tokens) > max_id:
                    max_id, max_line = max(tokens), lineno
            offset += len(line)
    if not offsets:
        raise DataError(f"{path} holds no token records; check the file")
    result = (np.array(offsets, np.int64), np.array(lengths, np.int64), np.array(last, np.int64), max_id, max_line)
    return result, (cache, key, result)


def _save_jsonl_index(cache: Path, key: np.ndarray, result: tuple) -> None:
    try:
        with atomic_path(cache) as tmp, open(tmp, "wb") as out:
            np.savez(out, key=key, offsets=result[0], lengths=result[1], last=result[2], max_id=np.int64(result[3]),
                     max_line=np.int64(result[4]))
    except OSError:
        pass  # a read-only data folder only costs a rebuild next time


def _parse_tokens_line(line: bytes, where: str) -> list[int]:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: malformed JSON ({e.args[0].split(':')[0]}); fix or remove the line") from None
    tokens = record.get("tokens") if isinstance(record, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise DataError(f"{where}: 'tokens' must be a non-empty list of non-negative ints; fix or remove the line")
    if "length" in record and record["length"] != len(tokens):
        raise DataError(
            f"{where}: 'length' is {record['length']} but 'tokens' has {len(tokens)}; fix the line"
        )
    return tokens


def read_index(folder: Path) -> dict:
    """index.json of a prepare-data output folder."""
    path = folder / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
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


def _raw_dataset(paths: list[Path], tokenizer: Tokenizer | None, text_field: str, description: str) -> InMemoryDataset:
    if tokenizer is None:
        raise DataError(f"{description} is raw text and needs a tokenizer; set data.tokenizer")
    size = sum(p.stat().st_size for p in paths)
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


def _first_record(path: Path) -> object:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def open_dataset(path: str, tokenizer: Tokenizer | None, text_field: str = "text") -> TokenDataset:
    """The dataset data.path names: '' = built-in corpus, a prepare-data folder, a tokens JSONL or raw text."""
    if not path:
        return _raw_dataset([builtin_corpus_path()], tokenizer, "text", "built-in corpus (Python docs)")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path {path} does not exist; set data.path to a file or folder (or '' for the built-in)")
    eos = tokenizer.eos_id if tokenizer is not None else None
    if p.is_dir():
        if (p / INDEX_FILE).is_file():
            index = read_index(p)
            if index["kind"] == "jsonl":
                return TokensJsonlDataset(p / TOKENS_JSONL, index["tokenizer"]["eos_id"],
                                          index["tokenizer"]["fingerprint"], index["tokenizer"].get("spec"))
            return ShardDataset(p, index)
        if (p / PROGRESS_FILE).is_file():
            raise DataError(f"{path} is an unfinished prepare-data output; re-run the same prepare-data to finish it")
        return _raw_dataset(discover_inputs([str(p)]), tokenizer, text_field, str(p))
    kind = source_kind(p)
    if kind == "jsonl":
        record = _first_record(p) if p.suffix == ".jsonl" else None
        if isinstance(record, dict) and "tokens" in record:
            return TokensJsonlDataset(p, eos)
    return _raw_dataset([p], tokenizer, text_field, str(p))


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

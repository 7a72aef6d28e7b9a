"""Raw corpora: find input files and read documents from .txt / .jsonl / .json / .parquet, optionally .gz / .zst."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from titan_npu.atomic import atomic_path
from titan_npu.data.files import BadRecords, not_regular, open_input, os_error, regular_stat, warn_once
from titan_npu.data.hf_datasets import HFDocumentReader, HFSource, hf_source, is_saved_dataset
from titan_npu.errors import DataError
from titan_npu.outputs import is_prepared

TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".zst")
BUILTIN_CORPUS = "python_docs.txt.gz"
BUILTIN_CHAT = "toy_chat.jsonl"

Input = Path | HFSource  # a file, or a Hugging Face dataset on disk (hf_datasets.py)


def builtin_chat_path() -> Path:
    """The chat corpus shipped inside the package (data.format = "chat" with data.path = ""): 320 toy conversations
    written by examples/make_toy_chat.py."""
    return Path(__file__).parent / "corpus" / BUILTIN_CHAT


def builtin_corpus_path() -> Path:
    """The corpus shipped inside the package: CPython's documentation topics, paragraphs as documents."""
    return Path(__file__).parent / "corpus" / BUILTIN_CORPUS


def write_builtin_corpus(path: Path | None = None) -> Path:
    """Regenerate the built-in corpus from this Python's pydoc_data.topics (byte-identical for one Python version)."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        paragraph: list[str] = []
        for line in topics[key].splitlines() + [""]:
            line = line.rstrip()
            if line:
                paragraph.append(line)
            elif paragraph:
                docs.append("\n".join(paragraph))
                paragraph = []
    path = path or builtin_corpus_path()
    with atomic_path(path) as tmp, open(tmp, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(("\n\n".join(docs) + "\n").encode("utf-8"))
    return path


def source_kind(path: Path) -> str:
    """'txt' | 'jsonl' | 'json' | 'parquet' from the name, looking through one .gz / .zst suffix."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1] in TEXT_SUFFIXES:
        return suffixes[-1][1:]
    raise DataError(
        f"{path}: unsupported input type; use .txt, .jsonl, .json or .parquet (optionally .gz or .zst)"
    )


def _is_supported(path: Path) -> bool:
    try:
        source_kind(path)
    except DataError:
        return False
    return True


def prepared_folder(path: Path) -> Path | None:
    """The prepare-data output folder that `path` is or lies in, if any."""
    for folder in (path, *path.parents) if path.is_dir() else path.parents:
        if is_prepared(folder):
            return folder
    return None


def _corpus_files(folder: Path, skipped: list[str], seen: set[Path] | None = None) -> list[Input]:
    """Supported files under folder, sorted, leaving out prepare-data outputs found inside it (our own files);
    what else it holds is named in `skipped`. DataError for an unreadable folder or a FIFO / device among them."""
    seen = set() if seen is None else seen
    if folder.resolve() in seen or is_prepared(folder):
        return []
    seen.add(folder.resolve())  # a symlink back up the tree is walked once
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        raise os_error(folder, e, "list the folder") from None
    found: list[Input] = []
    for entry in entries:
        try:
            mode = entry.stat().st_mode
        except FileNotFoundError:
            skipped.append(f"{entry} (a symlink to {os.readlink(entry)}, which does not exist)")
            continue
        except OSError as e:  # a symlink loop, a path too long, a permission on the way
            skipped.append(f"{entry} ({e.strerror or type(e).__name__})")
            continue
        if stat.S_ISDIR(mode) and is_saved_dataset(entry):  # a Hugging Face save_to_disk folder: one input
            found.append(HFSource(str(entry), folder=entry))
        elif stat.S_ISDIR(mode):
            found += _corpus_files(entry, skipped, seen)
        elif not _is_supported(entry):
            if not entry.name.endswith(_OUR_CACHES):
                skipped.append(f"{entry} (not .txt/.jsonl/.json/.parquet)")
        elif not stat.S_ISREG(mode):
            raise not_regular(entry, mode, "remove it from the folder or replace it by a regular file")
        else:
            found.append(entry)
    return found


_OUR_CACHES = (".titan-index.npz",)  # the offset index kept beside a tokens JSONL (datasets.py)


def _warn_skipped(spec: str, skipped: list[str]) -> None:
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        warn_once(f"{spec}: skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} that are not inputs: "
                  f"{'; '.join(skipped[:3])}{more}")


def _not_prepared(path: Path, spec: str) -> None:
    folder = prepared_folder(path)
    if folder is not None:
        raise DataError(f"input {spec} is a prepare-data output ({folder}), not a corpus; give the raw files, or "
                        "train on it with data.path")


def _mode(path: Path) -> int | None:
    """st_mode of path (links followed); None when nothing is there (or a link points nowhere)."""
    try:
        return path.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise os_error(path, e, "look at") from None


def missing_input(path: Path, spec: str, what: str = "input") -> DataError:
    """The refusal of a path where no file is: a dangling symlink is said to be one."""
    if os.path.lexists(path):
        return DataError(f"{what} {spec} is a symlink to {os.readlink(path)}, which does not exist; fix or remove "
                         "the link")
    return DataError(f"{what} {spec} does not exist; check the path")


def _input_key(item: Input) -> object:
    """What makes two inputs the same: a file's real path; an HF dataset's folder (or name) and split."""
    if isinstance(item, HFSource):
        return ("hf", str(item.folder.resolve()) if item.folder and not item.name else item.name, item.subset,
                item.split)
    return item.resolve()


def discover_inputs(inputs: list[str]) -> list[Input]:
    """Files named by inputs (files, directories searched recursively, globs), sorted within each input, no repeats;
    a Hugging Face dataset (hf://name or a save_to_disk folder, see hf_datasets.py) is one input of its own.

    Never our own outputs: folders that prepare-data wrote are skipped in a search and refused when named. Entries
    of a folder or a glob that are not inputs (other types, dangling symlinks) are named in one warning line; a FIFO
    or a device is refused (reading one could block or never end).
    """
    found: list[Input] = []
    for spec in inputs:
        hf = hf_source(spec)
        if hf is not None:
            hf.open()  # a name not on disk, a split or subset not there: refused before anything is written
            if _input_key(hf) not in {_input_key(f) for f in found}:
                found.append(hf)
            continue
        path = Path(spec).expanduser()
        mode = _mode(path)
        skipped: list[str] = []
        matches: list[Input]
        if mode is not None and stat.S_ISDIR(mode):
            _not_prepared(path, spec)
            matches = _corpus_files(path, skipped)
            if not matches:
                raise DataError(f"directory {spec} holds no .txt/.jsonl/.json/.parquet files; check the path")
        elif mode is not None and stat.S_ISREG(mode):
            _not_prepared(path, spec)
            source_kind(path)
            matches = [path]
        elif mode is not None:
            raise not_regular(spec, mode, "give a regular file or a folder of them (copy a stream into a file first)")
        elif glob.has_magic(spec) and not os.path.lexists(path):
            matches = []
            for p in sorted(Path(p) for p in glob.glob(str(path), recursive=True)):
                m = _mode(p)
                if m is None:
                    skipped.append(f"{p} (a symlink to {os.readlink(p)}, which does not exist)")
                elif stat.S_ISDIR(m) or not _is_supported(p) or prepared_folder(p) is not None \
                        or is_saved_dataset(p.parent):  # a save_to_disk folder's own files are not a corpus
                    continue
                elif not stat.S_ISREG(m):
                    raise not_regular(p, m, "leave it out of the pattern or replace it by a regular file")
                else:
                    matches.append(p)
            if not matches:
                raise DataError(f"pattern {spec} matches no .txt/.jsonl/.json/.parquet files; check the pattern")
        else:
            raise missing_input(path, spec)
        _warn_skipped(spec, skipped)
        for m in matches:
            if _input_key(m) not in {_input_key(f) for f in found}:
                found.append(m)
    if not found:
        raise DataError("no input files given; name files, directories or globs")
    return found


def _open_stream(raw: BinaryIO, path: Path) -> BinaryIO:
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst needs the 'zstandard' package; pip install zstandard") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def _stream_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged, truncated or mislabelled (.gz / .zst) input raises, besides DataError."""
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


class DocumentReader:
    """Iterates the documents (non-empty strings) of one input file; bytes_read tracks progress on disk."""

    def __init__(self, path: Path, text_field: str = "text", doc_sep: str = "blank", bad: BadRecords | None = None):
        if doc_sep not in ("blank", "line"):
            raise DataError(f"document separator {doc_sep!r} is unknown; use 'blank' or 'line'")
        self.path = path
        self.kind = source_kind(path)
        self.text_field = text_field
        self.doc_sep = doc_sep
        self.bad = bad or BadRecords()
        self.bytes_read = 0
        self.size = regular_stat(path).st_size

    def __iter__(self) -> Iterator[str]:
        with open_input(self.path) as raw:
            if self.kind == "parquet":
                yield from self._parquet(raw)
                return
            stream = _open_stream(raw, self.path)
            try:
                if self.kind == "txt":
                    yield from self._txt(stream, raw)
                elif self.kind == "jsonl" or (self.kind == "json" and not self._starts_with_bracket(stream)):
                    yield from self._jsonl(stream, raw)
                else:
                    yield from self._json_array(stream)
            except _stream_errors() as e:  # a corrupt or mislabelled compressed stream, a read error mid-file
                what = f"is not a valid {self.path.suffix} file or is damaged" \
                    if self.path.suffix.lower() in COMPRESSED_SUFFIXES else "cannot be read"
                why = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__
                raise DataError(f"{self.path}: {what} ({why}); check or re-download the file") from None
            finally:
                self.bytes_read = self.size

    @staticmethod
    def _starts_with_bracket(stream: BinaryIO) -> bool:
        peek = stream.peek(256) if hasattr(stream, "peek") else b""
        return peek.lstrip().startswith(b"[")

    def _decode(self, line: bytes, lineno: int) -> str | None:
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError as e:
            self.bad.report(f"{self.path}:{lineno}", f"not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})")
            return None

    def _txt(self, stream: BinaryIO, raw: BinaryIO) -> Iterator[str]:
        block: list[str] = []
        broken = False
        for lineno, line in enumerate(stream, 1):
            text = self._decode(line, lineno)
            self.bytes_read = raw.tell()
            if text is None:
                broken = True
                continue
            text = text.rstrip("\r\n")
            if self.doc_sep == "line":
                if text.strip():
                    yield text
            elif text.strip():
                block.append(text)
            else:
                if block and not broken:
                    yield "\n".join(block)
                block, broken = [], False
        if block and not broken:
            yield "\n".join(block)

    def _text_of(self, record: object, where: str) -> str | None:
        if not isinstance(record, dict):
            self.bad.report(where, f"expected a JSON object with a '{self.text_field}' field")
            return None
        if self.text_field not in record:
            fields = ", ".join(sorted(record)) or "none"
            self.bad.report(where, f"no '{self.text_field}' field (fields: {fields}); set --text-field")
            return None
        text = record[self.text_field]
        if not isinstance(text, str):
            self.bad.report(where, f"'{self.text_field}' is a {type(text).__name__}, not a string")
            return None
        if not text.strip():
            self.bad.report(where, f"empty '{self.text_field}' field")
            return None
        return text

    def _jsonl(self, stream: BinaryIO, raw: BinaryIO) -> Iterator[str]:
        for lineno, line in enumerate(stream, 1):
            self.bytes_read = raw.tell()
            if not line.strip():
                continue
            where = f"{self.path}:{lineno}"
            decoded = self._decode(line, lineno)
            if decoded is None:
                continue
            try:
                record = json.loads(decoded)
            except ValueError as e:
                self.bad.report(where, f"malformed JSON ({e.args[0].split(':')[0]})")
                continue
            text = self._text_of(record, where)
            if text is not None:
                yield text

    def _json_array(self, stream: BinaryIO) -> Iterator[str]:
        try:
            records = json.loads(stream.read().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{self.path}: not UTF-8 (at byte {e.start}); re-encode the file as UTF-8") from None
        except ValueError as e:
            raise DataError(f"{self.path}: malformed JSON ({e}); fix the file") from None
        if not isinstance(records, list):
            raise DataError(f"{self.path}: expected a JSON array of objects or JSON Lines; convert the file")
        for i, record in enumerate(records):
            text = self._text_of(record, f"{self.path}[{i}]")
            if text is not None:
                yield text

    def _parquet(self, raw: BinaryIO) -> Iterator[str]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{self.path}: reading .parquet needs the 'pyarrow' package; pip install pyarrow") from None
        try:
            pf = pq.ParquetFile(raw)
            columns = pf.schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid and friends
            raise DataError(f"{self.path}: not a readable Parquet file ({e}); check the file") from None
        if self.text_field not in columns:
            raise DataError(
                f"{self.path}: no '{self.text_field}' column (columns: {', '.join(columns)}); set --text-field"
            )
        row = 0
        for group in range(pf.num_row_groups):
            try:
                values = pf.read_row_group(group, columns=[self.text_field]).column(0).to_pylist()
            except Exception as e:  # a damaged page or row group, a read error mid-file
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(f"{self.path}: row group {group} cannot be read ({why}); check or re-download the "
                                "file") from None
            for value in values:
                row += 1
                if not isinstance(value, str) or not value.strip():
                    self.bad.report(f"{self.path}:row {row}", f"empty or non-string '{self.text_field}'")
                    continue
                yield value
            self.bytes_read = self.size * (group + 1) // pf.num_row_groups


def open_reader(item: Input, text_field: str = "text", doc_sep: str = "blank",
                bad: BadRecords | None = None) -> DocumentReader | HFDocumentReader:
    """The document reader of one input: a file, or a Hugging Face dataset's rows."""
    if isinstance(item, HFSource):
        return HFDocumentReader(item, text_field, bad)
    return DocumentReader(item, text_field, doc_sep, bad)


def input_size(item: Input) -> int:
    """Bytes on disk of one input (a Hugging Face dataset's: the files its split reads)."""
    return item.size if isinstance(item, HFSource) else item.stat().st_size


def iter_documents(paths: list[Input], text_field: str = "text", doc_sep: str = "blank",
                   bad: BadRecords | None = None) -> Iterator[str]:
    """Documents of every input in order."""
    for path in paths:
        yield from open_reader(path, text_field, doc_sep, bad)

"""Hugging Face datasets already on this machine as inputs: a `save_to_disk` folder, or a dataset in the local HF
cache by name (`hf://namespace/name[/subset][?split=train]`), read through the `datasets` library, offline.

Nothing is ever downloaded: every call into the library runs with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set. A name
is looked up first in the datasets cache (HF_DATASETS_CACHE, what an earlier `load_dataset(name)` prepared: Arrow,
memory-mapped), then in the hub cache (HF_HUB_CACHE, what `hf download <name> --repo-type dataset`, formerly
`huggingface-cli download`, fetched: its files are streamed, never converted; a partial download is read as it is,
with a warning). Documents are read in batches from Arrow, never all at once.

The split: the one named (`?split=` or the caller's `split`); else the only one; else 'train' when there is one;
else refused naming the splits there are. The `datasets` package is imported only when such an input is used.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from titan_npu.data.files import BadRecords, os_error, warn_once
from titan_npu.errors import DataError

HF_PREFIX = "hf://"
DATASETS_VERSION = "5.2.0"  # pyproject.toml's hf extra pins it
_INSTALL = f"pip install 'titan-npu[hf]' (datasets=={DATASETS_VERSION})"
_BATCH_ROWS = 1024  # rows read from Arrow at a time
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")  # a namespace or a repo name on the Hub


def is_saved_dataset(folder: Path) -> bool:
    """True when folder is what `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk`
    (dataset_dict.json) wrote."""
    try:
        return folder.is_dir() and ((folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file())
    except OSError:
        return False


def _has_arrow_dataset(folder: Path) -> bool:
    """True when folder holds a Hugging Face dataset's own files (dataset_info.json, .arrow) without being a
    save_to_disk folder: a datasets-cache folder, or a save_to_disk folder that lost its state.json."""
    try:
        return folder.is_dir() and ((folder / "dataset_info.json").is_file() or any(folder.glob("*.arrow")))
    except OSError:
        return False


def is_hf_spec(spec: str) -> bool:
    """True when spec names a dataset in the HF cache (hf://...)."""
    return spec.startswith(HF_PREFIX)


@dataclass
class HFSource:
    """One Hugging Face dataset input: a repo id in the HF cache (name) or a save_to_disk folder, with its
    subset (config) and split. Opened on first use; messages name it by `spec`."""

    spec: str
    name: str = ""
    folder: Path | None = None
    subset: str = ""
    split: str = ""
    _opened: tuple | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return self.spec

    def open(self) -> tuple[Any, list[Path], int | None]:
        """(dataset of the chosen split, the files it reads, its number of rows when known)."""
        if self._opened is None:
            self._opened = _open(self)
        return self._opened

    @property
    def size(self) -> int:
        """Bytes on disk of the files the chosen split reads."""
        return sum(_file_size(p) for p in self.open()[1])

    def describe(self) -> dict:
        """What identifies this input's content for prepare-data's up-to-date check: its files, sizes and mtimes."""
        _, files, rows = self.open()
        h = hashlib.blake2b(digest_size=16)
        for p in sorted(files):
            st = p.stat()
            h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"path": self.spec, "subset": self.subset, "split": self.split, "rows": rows,
                "size": sum(_file_size(p) for p in files), "files": h.hexdigest()}


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def hf_source(spec: str, subset: str = "", split: str = "") -> HFSource | None:
    """The HF dataset spec names (hf://... or a save_to_disk folder), else None; DataError for a malformed hf://."""
    if is_hf_spec(spec):
        return parse_hf(spec, subset, split)
    folder = Path(spec).expanduser()
    if is_saved_dataset(folder):
        return HFSource(spec, folder=folder, subset=subset, split=split)
    if _has_arrow_dataset(folder):
        raise DataError(f"{spec} holds a Hugging Face dataset's files (dataset_info.json / .arrow) but is not a "
                        "save_to_disk folder (no state.json or dataset_dict.json); give the folder "
                        "Dataset.save_to_disk wrote, or hf://namespace/name for a dataset in the HF cache")
    if subset or split:
        raise DataError(f"{spec}: subset/split apply to Hugging Face datasets only (hf://name or a save_to_disk "
                        "folder); leave them out for this input")
    return None


def parse_hf(spec: str, subset: str = "", split: str = "") -> HFSource:
    """hf://[datasets/]namespace/name[/subset][?subset=..&split=..]; subset/split given also as arguments."""
    body, _, query = spec[len(HF_PREFIX):].partition("?")
    if body.startswith("datasets/"):  # the Hub's own URL spelling
        body = body[len("datasets/"):]
    parts = [p for p in body.split("/") if p]
    usage = "write hf://namespace/name, hf://namespace/name/subset or hf://namespace/name?split=train"
    if body.startswith("/") or body.startswith(".") or not parts or len(parts) > 3:
        raise DataError(f"{spec} is not a dataset name in the HF cache; {usage} (a save_to_disk folder is given as "
                        "its plain path)")
    options: dict[str, str] = {}
    if query:
        try:
            options = dict(parse_qsl(query, strict_parsing=True))
        except ValueError:
            raise DataError(f"{spec}: cannot read the options after '?'; {usage}") from None
        unknown = sorted(set(options) - {"subset", "split"})
        if unknown:
            raise DataError(f"{spec}: unknown option {unknown[0]!r} (only subset and split); {usage}")
    name = "/".join(parts[:2])
    bad = next((part for part in parts[:2] if not _REPO_PART.fullmatch(part) or ".." in part), None)
    if bad is not None:
        raise DataError(f"{spec}: {bad!r} is not a valid Hugging Face dataset name (letters, digits, '-', '_', '.'); "
                        f"{usage}")
    given = {"subset": parts[2] if len(parts) == 3 else options.get("subset", ""), "split": options.get("split", "")}
    if len(parts) == 3 and "subset" in options and options["subset"] != parts[2]:
        raise DataError(f"{spec} names two subsets ({parts[2]}, {options['subset']}); give one")
    for key, value in (("subset", subset), ("split", split)):
        if value and given[key] and value != given[key]:
            raise DataError(f"{spec} says {key} {given[key]} but {key} = {value!r} is also given; give one")
        given[key] = given[key] or value
    return HFSource(spec, name=name, subset=given["subset"], split=given["split"])


_offline_depth = [0]


@contextmanager
def offline() -> Iterator[Any]:
    """The `datasets` module, with the HF libraries held offline (environment and their import-time settings)."""
    saved = {k: os.environ.get(k) for k in _OFFLINE_VARS}
    os.environ.update({k: "1" for k in _OFFLINE_VARS})
    try:
        import datasets
        import huggingface_hub.constants as hub_constants
    except ImportError:
        _restore_env(saved)
        raise DataError(f"reading a Hugging Face dataset needs the 'datasets' package; {_INSTALL}") from None
    settings = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    if _offline_depth[0] == 0:
        datasets.utils.logging.set_verbosity_error()  # its notes on cache look-ups are not ours to print
        datasets.disable_progress_bars()
    _offline_depth[0] += 1
    try:
        yield datasets
    finally:
        _offline_depth[0] -= 1
        if _offline_depth[0] == 0:
            datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = settings
            _restore_env(saved)


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _why(e: BaseException) -> str:
    """A library error in one line: its message's lines joined."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return "; ".join(lines)[:400] or type(e).__name__


def _open(src: HFSource) -> tuple[Any, list[Path], int | None]:
    with offline() as datasets:
        if src.folder is not None:
            data = _load_saved(datasets, src)
        else:
            data = _load_cached(datasets, src)
        ds = _choose_split(datasets, src, data)
        if isinstance(ds, datasets.Dataset):
            files = [Path(f["filename"]) for f in ds.cache_files]
            return ds, files, ds.num_rows
        return ds, sorted(p for p in src.folder.rglob("*") if p.is_file()) if src.folder else [], None


def _load_saved(datasets: Any, src: HFSource) -> Any:
    if src.subset:
        raise DataError(f"{src.spec} is a save_to_disk folder, which has no subsets; leave subset out")
    try:
        return datasets.load_from_disk(str(src.folder))
    except OSError as e:  # permission denied, an I/O error: the file and the fix, as for any input
        if e.errno is None:
            raise DataError(f"{src.spec} looks like a Hugging Face save_to_disk folder but cannot be loaded "
                            f"({_why(e)}); save it again with Dataset.save_to_disk") from None
        raise os_error(e.filename or src.folder, e) from None
    except Exception as e:  # the library raises ValueError, ArrowInvalid, JSONDecodeError, ...
        raise DataError(f"{src.spec} looks like a Hugging Face save_to_disk folder but cannot be loaded ({_why(e)}); "
                        "save it again with Dataset.save_to_disk, or give a folder of .txt/.jsonl/.json/.parquet"
                        ) from None


def _missing(datasets: Any, src: HFSource) -> DataError:
    import huggingface_hub.constants as hub_constants

    return DataError(
        f"Hugging Face dataset {src.name} is not on this machine (looked in {datasets.config.HF_DATASETS_CACHE} and "
        f"{hub_constants.HF_HUB_CACHE}; nothing is downloaded); fetch it first: hf download {src.name} --repo-type "
        "dataset (huggingface-cli download, its older name), then run with HF_HUB_OFFLINE=1 (or point HF_HOME at the "
        "cache that holds it)")


def _load_cached(datasets: Any, src: HFSource) -> Any:
    """The dataset from the datasets cache (prepared Arrow) or else the hub cache (downloaded files, streamed)."""
    from huggingface_hub import snapshot_download

    config = src.subset or None
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / _cache_dir_name(src.name)
    if prepared.is_dir() and any(prepared.glob("*/*/*/dataset_info.json")):
        try:
            return datasets.load_dataset(src.name, config)
        except Exception as e:  # a subset not prepared there, several subsets and none chosen, a damaged cache
            raise DataError(f"{src.spec}: {_why(e)} (in {prepared}); name one of its subsets: hf://{src.name}/<subset>"
                            ) from None
    from huggingface_hub.errors import IncompleteSnapshotError

    try:
        snapshot = snapshot_download(src.name, repo_type="dataset", local_files_only=True)
    except IncompleteSnapshotError as e:  # a download of some files only (--include), or one cut short
        snapshot = e.snapshot_path
        warn_once(f"{src.spec}: the cached snapshot {snapshot} holds only part of the repository (downloaded with "
                  "--include, or interrupted); reading the files that are there")
    except Exception:  # LocalEntryNotFoundError (not downloaded), a malformed repo id
        raise _missing(datasets, src) from None
    src.folder = Path(snapshot)
    try:
        return datasets.load_dataset(snapshot, config, streaming=True)
    except Exception as e:  # a subset that is not there, several and none chosen, no data files
        raise DataError(f"{src.spec}: {_why(e)} (in {snapshot}); name one of its subsets: hf://{src.name}/<subset>"
                        ) from None


def _cache_dir_name(name: str) -> str:
    """The folder of `name` in the datasets cache, as the library names it (namespace___snake_case_name)."""
    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    return "___".join(parts)


def _choose_split(datasets: Any, src: HFSource, data: Any) -> Any:
    if not isinstance(data, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if src.split:
            raise DataError(f"{src.spec} is a single split (a Dataset, not a DatasetDict); leave split out")
        return data
    splits = list(data)
    if src.split:
        if src.split not in data:
            raise DataError(f"{src.spec} has no split {src.split!r} (splits: {', '.join(splits) or 'none'}); "
                            "name one of those")
        return data[src.split]
    if len(splits) == 1:
        return data[splits[0]]
    if "train" in data:
        return data["train"]
    where = f"{src.spec}?split=<split>" if is_hf_spec(src.spec) else f"{src.spec}/<split>"
    raise DataError(f"{src.spec} has several splits and none is 'train' ({', '.join(splits)}); choose one: {where}")


class HFDocumentReader:
    """Iterates the documents of one HF dataset input, in batches of rows; bytes_read tracks progress."""

    def __init__(self, src: HFSource, text_field: str = "text", bad: Any = None):
        self.path = src
        self.src = src
        self.text_field = text_field
        self.bad = bad or BadRecords()
        self.bytes_read = 0
        self.size = src.size
        ds, _, rows = src.open()
        columns = ds.column_names
        if columns is not None:
            self._check_field(columns)
        self.rows = rows

    def _check_field(self, columns: list[str]) -> None:
        if self.text_field not in columns:
            raise DataError(f"{self.src}: no '{self.text_field}' column (columns: {', '.join(columns) or 'none'}); "
                            "set --text-field (data.text_field)")

    def __iter__(self) -> Iterator[str]:
        ds, _, rows = self.src.open()
        row = 0
        with offline():
            try:
                if ds.column_names is not None:
                    ds = ds.select_columns([self.text_field])
                batches = ds.iter(batch_size=_BATCH_ROWS)
                for batch in batches:
                    if self.text_field not in batch:
                        self._check_field(list(batch))
                    for value in batch[self.text_field]:
                        row += 1
                        if not isinstance(value, str) or not value.strip():
                            self.bad.report(f"{self.src}:row {row}", f"empty or non-string '{self.text_field}'")
                            continue
                        yield value
                    if rows:
                        self.bytes_read = self.size * row // rows
            except DataError:
                raise
            except Exception as e:  # a damaged Arrow or Parquet file found mid-read
                raise DataError(f"{self.src}: cannot be read at row {row + 1} ({_why(e)}); check the dataset or "
                                "download it again") from None
            finally:
                self.bytes_read = self.size


"""Reading torch.distributed.checkpoint (DCP) directories without executing what the files bring.

DCP stores its index (.metadata) as a pickle and non-tensor values with torch.save. Its stock reader unpickles
both without restriction; here the index is read with an unpickler that only builds DCP's own metadata types,
and non-tensor values are loaded with torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    DefaultLoadPlanner,
    FileSystemReader,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import ReadItem

from titan_npu.checkpoint import storage
from titan_npu.errors import CheckpointError

# DCP warns on every single-process save/load even when asked for one (no_dist=True); that is the intent here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized",
                        category=UserWarning)

# (module, name) pairs the DCP index may reference; everything else is refused.
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint index")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose .metadata is read with an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not a DCP index (found {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: str | Path, verify: bool = True, digests: bool = True) -> Metadata:
    """The DCP index of a checkpoint directory (keys, shapes, dtypes), read safely; with `verify`, every data file
    it names is checked to be there and as long as the index says (a truncated copy is refused before any read),
    and with `digests` every file to be the one the save wrote (by the digests in checkpoint.json)."""
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as e:
        raise damaged(Path(path), f"{path}/.metadata is unreadable ({type(e).__name__}: {one_line(e)})") from e
    if verify:
        problem = data_file_problem(Path(path), metadata) or (_info_content_problem(Path(path)) if digests else None)
        if problem is not None:
            raise damaged(Path(path), problem)
    return metadata


def _info_content_problem(path: Path) -> str | None:
    """What checkpoint.json says is wrong with the checkpoint's files (or with checkpoint.json itself), or None."""
    if not (path / storage.INFO_FILE).is_file():
        return None  # a bare DCP directory (not ours): its index is all there is to check
    return storage.recorded_problem(path)


def integrity_problem(path: str | Path) -> str | None:
    """Why checkpoint `path` cannot be used as saved (checkpoint.json, its index, its files by size and digest), or
    None when it is intact."""
    path = Path(path)
    problem = storage.info_problem(path)
    if problem is not None:
        return problem
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 -- any unreadable index makes the checkpoint unusable
        return f"{path}/.metadata is unreadable ({type(e).__name__}: {one_line(e)})"
    return data_file_problem(path, metadata) or _info_content_problem(path)


def one_line(error: BaseException) -> str:
    """An exception's text cut to its first sentence (torch's weights_only refusals run to a dozen lines, with
    terminal colours and advice to load the file unsafely)."""
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) and "weights only load failed" in text.lower():
        return "it holds Python objects besides tensors and plain values, which could run code when loaded"
    if isinstance(error, EOFError) and not text:
        return "the file ends early: empty or cut short"
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip()
    first = (text.splitlines() or ["no detail"])[0]
    return first.split(". ")[0].rstrip(".")


def data_file_problem(path: Path, metadata: Metadata) -> str | None:
    """What is wrong with the data files of a checkpoint next to its index ('<file> is N bytes but ...'), or None."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        found = file.stat().st_size
        if found < size:
            return f"{file} is {found} bytes but its index (.metadata) needs {size} (truncated copy or save)"
    return None


def earlier_intact(path: Path) -> storage.CheckpointRef | None:
    """The newest complete checkpoint beside `path` with a lower step that is intact (integrity_problem), if any."""
    match = re.fullmatch(rf"{storage.PREFIX}(\d+)", path.name)
    step = int(match.group(1)) if match else None
    for ref in reversed(storage.list_checkpoints(path.parent)):
        if step is not None and ref.step >= step or ref.path.resolve() == path.resolve():
            continue
        if integrity_problem(ref.path) is None:
            return ref
    return None


def damaged(checkpoint: Path, problem: str) -> CheckpointError:
    """The one-line refusal of a damaged checkpoint: what is wrong, and the intact checkpoint before it."""
    earlier = earlier_intact(checkpoint)
    fix = (f"use the intact step {earlier.step} before it (train: --checkpoint.resume {earlier.step}; export, "
           f"generate: --checkpoint {earlier.path})" if earlier is not None
           else f"no earlier intact checkpoint is in {checkpoint.parent}; start again or restore the files")
    return CheckpointError(f"{problem}; the checkpoint {checkpoint} is damaged: {fix}")


def tensor_entries(metadata: Metadata, prefix: str = "") -> dict[str, TensorStorageMetadata]:
    """Tensor entries of the index under `prefix` (e.g. 'model.'), keyed without the prefix."""
    return {
        key[len(prefix):]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def expected_entries(state_dict: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Flattened DCP keys of a (nested) state dict -> ('tensor', global shape) or ('bytes', None)."""
    flat, _ = flatten_state_dict(state_dict)
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            out[key] = ("tensor", tuple(value.shape))  # a DTensor's .shape is the global shape
        else:
            out[key] = ("bytes", None)
    return out


def checkpoint_entries(metadata: Metadata) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """The same view of what a checkpoint holds."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            out[key] = ("tensor", tuple(meta.size))
        elif isinstance(meta, BytesStorageMetadata):
            out[key] = ("bytes", None)
    return out


def load_tensors(path: str | Path, metadata: Metadata, keys: list[str], dtype: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """Read the full (unsharded) tensors `keys` of a checkpoint in this process only, optionally cast to dtype."""
    from torch.distributed.checkpoint import load

    entries = metadata.state_dict_metadata
    state = {}
    for key in keys:
        meta = entries[key]
        state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    try:
        load(state, storage_reader=SafeFileSystemReader(str(path)),
             planner=SafeLoadPlanner(allow_partial_load=True), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # torch reports a damaged file as a many-line CheckpointException
        raise damaged(Path(path), f"{path} cannot be read ({type(e).__name__}: {one_line(e)})") from e
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return state

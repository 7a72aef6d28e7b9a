"""Checkpoint directories on disk: naming, what counts as complete, atomic publishing and rotation.

A checkpoint of step N is the directory `<dir>/step-N`. It is written as `<dir>/step-N.tmp` and renamed to its
final name only after every rank has written its part and rank 0 has written `checkpoint.json`, so a directory
named `step-N` is always complete and a crash mid-save leaves the previous one as the latest. Old checkpoints are
renamed to `.step-N.deleting` before removal, so a crash mid-delete never leaves a half-deleted `step-N`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_npu.atomic import atomic_write_json, replace_dir
from titan_npu.errors import CheckpointError
from titan_npu.regular_files import read_regular_text

PREFIX = "step-"
TMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
INFO_FILE = "checkpoint.json"  # written last by rank 0: its presence marks a complete checkpoint
DCP_METADATA = ".metadata"  # written by torch.distributed.checkpoint once all ranks' data files are written
CONFIG_FILE = "config.toml"
FORMAT_NAME = "titan-npu-dcp"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")
FILES_KEY = "files"  # checkpoint.json: every other file of the checkpoint -> its size and digest
# A file up to this size is digested whole; a larger one by its size and DIGEST_BLOCKS blocks spread over it
# (first and last included), so that writing and checking a checkpoint costs a bounded read per file.
DIGEST_FULL_BYTES = 16 << 20
DIGEST_BLOCKS = 16
DIGEST_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint on disk."""

    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    """Directory name of step N's checkpoint."""
    return f"{PREFIX}{step}"


def tmp_path(root: str | Path, step: int) -> Path:
    """Where step N's checkpoint is written before it is published."""
    return Path(root) / f"{checkpoint_name(step)}{TMP_SUFFIX}"


def is_complete(path: str | Path) -> bool:
    """True when `path` holds a finished checkpoint (DCP metadata and our info file are both there)."""
    path = Path(path)
    return (path / DCP_METADATA).is_file() and (path / INFO_FILE).is_file()


def list_checkpoints(root: str | Path) -> list[CheckpointRef]:
    """Complete checkpoints under `root`, oldest step first; unfinished (.tmp) and foreign entries are skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and is_complete(entry):
            found.append(CheckpointRef(int(match.group(1)), entry))
    return sorted(found, key=lambda ref: ref.step)


def latest_checkpoint(root: str | Path) -> CheckpointRef | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def latest_checkpoint_note(root: str | Path) -> str:
    """What a failed save leaves to resume from, for its error message."""
    latest = latest_checkpoint(root)
    if latest is None:
        return f"no complete checkpoint exists in {root} yet"
    return f"the latest complete checkpoint, step {latest.step} in {latest.path}, is intact"


def resolve_checkpoint(spec: str | int | Path, root: str | Path) -> CheckpointRef:
    """A step number (looked up in `root`) or a checkpoint path -> a complete checkpoint, or a CheckpointError."""
    text = str(spec).strip()
    if text.isdigit():
        step = int(text)
        path = Path(root) / checkpoint_name(step)
        if not is_complete(path):
            available = ", ".join(str(ref.step) for ref in list_checkpoints(root)) or "none"
            state = "is incomplete (its save did not finish)" if path.exists() or tmp_path(root, step).exists() \
                else "does not exist"
            raise CheckpointError(
                f"checkpoint step {step} in {root} {state}; complete steps there: {available}"
            )
        return CheckpointRef(step, path)
    path = Path(text)
    check_checkpoint_dir(path)
    return CheckpointRef(read_info(path)["step"], path)


def check_checkpoint_dir(path: str | Path) -> None:
    """Raise a CheckpointError that says what `path` is when it is not a complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; give a step-N directory written by training")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint directory; a full .pt or Hugging Face weights go to "
            "checkpoint.initial_load (or `titan-npu import`), not to checkpoint.resume / --checkpoint"
        )
    if path.name.endswith(TMP_SUFFIX) or ((path / DCP_METADATA).is_file() != (path / INFO_FILE).is_file()):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (its save did not finish); use the previous checkpoint in "
            f"{path.parent} (`checkpoint.resume = auto` picks the latest complete one)"
        )
    if not is_complete(path):
        inside = list_checkpoints(path)
        # The parent of several runs' checkpoint.dir (the shipped configs' checkpoints/<name>): name those runs.
        runs = [] if inside else [(d, refs[-1]) for d in sorted(p for p in path.iterdir() if p.is_dir())
                                  if (refs := list_checkpoints(d))]
        if inside:
            hint = f"it holds checkpoints: pass one of them, e.g. {inside[-1].path}"
        elif runs:
            names = ", ".join(d.name for d, _ in runs)
            hint = (f"its folder {names} holds checkpoints (the checkpoint.dir of a run)" if len(runs) == 1 else
                    f"its folders {names} hold checkpoints (each the checkpoint.dir of a run)")
            hint += f": pass one of them, e.g. {runs[0][1].path}"
        else:
            hint = "expected a step-N directory holding .metadata and checkpoint.json"
        raise CheckpointError(f"{path} is not a checkpoint; {hint}")


def info_problem(path: str | Path) -> str | None:
    """Why checkpoint.json of `path` cannot be read as JSON (cut short, corrupt, unreadable), or None."""
    info_path = Path(path) / INFO_FILE
    try:
        json.loads(read_regular_text(info_path))
    except (OSError, ValueError) as e:
        detail = str(e).splitlines()[0] if str(e) else "empty"
        return f"{info_path} is unreadable, cut short or corrupt ({type(e).__name__}: {detail})"
    return None


def read_info(path: str | Path) -> dict[str, Any]:
    """The checkpoint's checkpoint.json (step, tokens seen, layout, model shapes)."""
    info_path = Path(path) / INFO_FILE
    problem = info_problem(path)
    if problem is not None:
        raise CheckpointError(f"{problem}; the checkpoint {path} is damaged: {_earlier_step_hint(Path(path))}")
    info = json.loads(read_regular_text(info_path))
    if not isinstance(info, dict) or info.get("format") != FORMAT_NAME or not isinstance(info.get("step"), int):
        raise CheckpointError(f"{info_path} is not a {FORMAT_NAME} info file; is {path} a titan-npu checkpoint?")
    return info


def _earlier_step_hint(path: Path) -> str:
    """What to use instead of the damaged checkpoint `path`: the newest earlier one that checkpoint.json vouches for
    (dcp_io.damaged also checks the DCP index; this module is below it)."""
    match = _STEP_DIR.fullmatch(path.name)
    step = int(match.group(1)) if match else None
    for ref in reversed(list_checkpoints(path.parent)):
        if (step is None or ref.step < step) and ref.path.resolve() != path.resolve() \
                and recorded_problem(ref.path) is None:
            return (f"use the intact step {ref.step} before it (train: --checkpoint.resume {ref.step}; export, "
                    f"generate: --checkpoint {ref.path})")
    return f"no earlier intact checkpoint is in {path.parent}; start again or restore the files"


def file_digest(path: str | Path) -> str:
    """A digest of a file's content: sha256 of the whole file, or of its size and evenly spread blocks when large."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= DIGEST_FULL_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return f"sha256:{h.hexdigest()}"
        h.update(str(size).encode())
        last = size - DIGEST_BLOCK_BYTES
        for i in range(DIGEST_BLOCKS):
            f.seek(last * i // (DIGEST_BLOCKS - 1))
            h.update(f.read(DIGEST_BLOCK_BYTES))
    return f"sha256-sampled:{h.hexdigest()}"


def file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file of a checkpoint being published -> its size and digest (checkpoint.json aside, and the copy of
    the config, config.toml, which holds no state and which a person may annotate)."""
    out = {}
    for file in sorted(folder.rglob("*")):
        rel = file.relative_to(folder).as_posix()
        if file.is_file() and rel not in (INFO_FILE, CONFIG_FILE):
            out[rel] = {"size": file.stat().st_size, "digest": file_digest(file)}
    return out


def _is_checkpoint_file(rel: str) -> bool:
    """A name that only a save writes (a DCP data file, a rank's state): one not in the manifest is foreign."""
    return rel.endswith(".distcp") or rel.startswith("ranks/") or rel == DCP_METADATA


def content_problem(path: str | Path, info: dict[str, Any]) -> str | None:
    """How the files of checkpoint `path` differ from what its checkpoint.json describes, or None.

    Checkpoints written before digests were recorded are checked for their rank files only (one per rank saved).
    """
    path = Path(path)
    files = info.get(FILES_KEY)
    if not isinstance(files, dict):
        world = info.get("world_size")
        if isinstance(world, int):
            for rank in range(world):
                if not (path / "ranks" / f"rank-{rank}.pt").is_file():
                    return f"{path}/ranks/rank-{rank}.pt is missing (the checkpoint was saved by {world} ranks)"
        return None
    for rel, entry in sorted(files.items()):
        file = path / rel
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if not isinstance(entry, dict) or size != entry.get("size"):
            want = entry.get("size") if isinstance(entry, dict) else "?"
            return f"{file} is {size} bytes but checkpoint.json recorded {want} (replaced, truncated or cut)"
        if file_digest(file) != entry.get("digest"):
            return (f"{file} is not the file this checkpoint saved (its content differs from the digest in "
                    "checkpoint.json: replaced or rewritten since)")
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path).as_posix()
        if file.is_file() and rel not in files and _is_checkpoint_file(rel):
            return f"{file} is not part of this checkpoint (not in checkpoint.json; added since the save)"
    return None


def recorded_problem(path: str | Path) -> str | None:
    """What checkpoint.json says is wrong with checkpoint `path`: itself unreadable, or files not the ones it
    recorded (content_problem); None when it holds together (its DCP index is checked when it is read)."""
    problem = info_problem(path)
    if problem is not None:
        return problem
    info = json.loads(read_regular_text(Path(path) / INFO_FILE))
    if not isinstance(info, dict) or info.get("format") != FORMAT_NAME or not isinstance(info.get("step"), int):
        return f"{Path(path) / INFO_FILE} is not a {FORMAT_NAME} info file (corrupt, or written by another program)"
    return content_problem(path, info)


def publish(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """Write checkpoint.json into `tmp`, flush it to disk and rename `tmp` to `final` (rank 0, after all ranks).

    checkpoint.json records the size and digest of every other file, checked when the checkpoint is opened.
    """
    info = {**info, FILES_KEY: file_manifest(tmp)}
    atomic_write_json(tmp / INFO_FILE, {"format": FORMAT_NAME, "version": FORMAT_VERSION, **info}, indent=2)
    # An existing `final` (checkpoint.overwrite, or a repeated save of the same step) keeps its name until the new one
    # takes it, parked meanwhile as .step-N.deleting, which clean_unfinished removes after a crash.
    doomed = _doomed(final)
    shutil.rmtree(doomed, ignore_errors=True)  # left by an interrupted deletion
    replace_dir(tmp, final, doomed)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory: rename it out of sight first, then remove the files."""
    doomed = _doomed(path)
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rotate(root: str | Path, keep_last_n: int) -> list[int]:
    """Delete all but the newest `keep_last_n` complete checkpoints (keep_last_n <= 0 keeps all); deleted steps."""
    if keep_last_n <= 0:
        return []
    found = list_checkpoints(root)
    doomed = found[:-keep_last_n]
    for ref in doomed:
        remove_checkpoint(ref.path)
    return [ref.step for ref in doomed]


def clean_unfinished(root: str | Path) -> list[Path]:
    """Remove what interrupted saves and deletions left behind (step-N.tmp, .step-N.deleting); the removed paths."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        stem = entry.name
        if stem.endswith(TMP_SUFFIX) and _STEP_DIR.fullmatch(stem[: -len(TMP_SUFFIX)]) or (
            stem.startswith(".") and stem.endswith(DELETING_SUFFIX)
        ):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _doomed(path: Path) -> Path:
    """Where a checkpoint directory waits, out of sight, to be deleted."""
    return path.parent / f".{path.name}{DELETING_SUFFIX}"

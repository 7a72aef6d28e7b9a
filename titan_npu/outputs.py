"""The one rule of every command that writes: it never deletes or replaces what it did not write, whatever
--overwrite says, and a refusal names what would have been lost.

- Nothing is written into a checkpoint (a folder holding DCP's .metadata or checkpoint.json), a prepared dataset
  (prepare-data's output) or an export, nor over one: `refuse_protected`.
- A command that writes a whole folder (init-weights, export --format hf) leaves a marker in it,
  `.titan-<command>.json`, listing the files it wrote; --overwrite replaces such a folder only when it holds nothing
  else (`check_folder_output`).
- A command that writes one file (import, export --format pt) replaces, with --overwrite, only a file of the kind it
  writes (a torch archive), never a folder or another file (`check_file_output`).
- A command that adds named files to a folder others share (train's metrics.log_dir, report, train-tokenizer)
  never replaces a file of those names that it did not write (`refuse_foreign_names`).

Imports only the standard library (and the project's errors): any module may use it. The names that recognise a
checkpoint and a prepared dataset are the ones checkpoint/storage.py and data/sources.py write
(tests/reliability/test_bad_inputs_outputs.py holds them equal).
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from titan_npu.atomic import atomic_write_json
from titan_npu.errors import TitanError
from titan_npu.regular_files import open_regular, read_regular_text

CHECKPOINT_FILES = (".metadata", "checkpoint.json")  # DCP's metadata, titan-npu's info file: either marks a checkpoint
PREPARED_FORMAT = "titan-npu-tokens"  # index.json's "format" in a finished prepare-data output
PREPARED_INDEX, PREPARED_PROGRESS = "index.json", ".progress.json"
# What a training run writes into metrics.log_dir that could meet a file of the same name (folders such as
# tensorboard/ and watchdog/ only gain new files).
RUN_LOG_FILES = ("config.toml", "run_info.json", "metrics.jsonl", "report.md", "report.png")
_STEP_NAME = re.compile(r"step-\d+")


def marker_name(command: str) -> str:
    """The marker file `command` leaves in a folder it wrote: `.titan-<command>.json`."""
    return f".titan-{command}.json"


def write_marker(folder: Path, command: str, files: Iterable[str], **extra: object) -> None:
    """Record in `folder` that `command` wrote `files` there (what a later --overwrite may replace)."""
    atomic_write_json(folder / marker_name(command),
                      {**extra, "format": f"titan-npu-{command}", "files": sorted(set(files))}, indent=2)


def read_marker(folder: Path, command: str) -> dict | None:
    """`command`'s marker in `folder` (its "files" a list), or None when it has none."""
    try:
        marker = json.loads(read_regular_text(folder / marker_name(command)))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != f"titan-npu-{command}" or \
            not isinstance(marker.get("files"), list):
        return None
    return marker


def marker_files(folder: Path, command: str) -> set[str] | None:
    """The names `command`'s marker in `folder` lists (the marker included), or None when it has none."""
    marker = read_marker(folder, command)
    if marker is None:
        return None
    return {str(name) for name in marker["files"]} | {marker_name(command)}


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (hex): whether a file is still as a command wrote it."""
    digest = hashlib.sha256()
    with open_regular(path) as f:  # a FIFO put where the run's config.toml was: refused, never waited on
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_checkpoint(folder: Path) -> bool:
    """True when `folder` is a checkpoint, complete or cut short (DCP's metadata or titan-npu's info file)."""
    return any((folder / name).is_file() for name in CHECKPOINT_FILES)


def is_prepared(folder: Path) -> bool:
    """True when `folder` is a prepare-data output, finished or not (another tool's index.json is not one)."""
    for name, ours in ((PREPARED_INDEX, lambda d: d.get("format") == PREPARED_FORMAT),
                       (PREPARED_PROGRESS, lambda d: "settings" in d and "sources" in d)):
        try:
            data = json.loads(read_regular_text(folder / name))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and ours(data):
            return True
    return False


def kind_of(folder: Path) -> str | None:
    """'checkpoint', 'prepared dataset' or 'export' (a Hugging Face export) when `folder` is one, else None."""
    if not folder.is_dir():
        return None
    if is_checkpoint(folder):
        return "checkpoint"
    if is_prepared(folder):
        return "prepared dataset"
    if marker_files(folder, "export") is not None:
        return "export"
    return None


def protected_at(path: Path) -> tuple[str, str, Path] | None:
    """(relation, what, folder) when `path` is ('is') or lies inside ('lies inside') a checkpoint, a prepared
    dataset or an export (folders their command wrote whole), else None."""
    resolved = Path(path).expanduser().resolve()
    for folder in (resolved, *resolved.parents):
        what = kind_of(folder)
        if what is not None:
            return ("is" if folder == resolved else "lies inside"), what, folder
    return None


def refuse_protected(flag: str, path: Path, error: type[TitanError], fix: str | None = None,
                     allow: str | None = None) -> None:
    """`error` when `path` is or lies inside a checkpoint, a prepared dataset or an export (nothing is written there).

    `allow` ('checkpoint' | 'prepared dataset' | 'export') lets `path` itself be one: the command's own earlier
    output. `fix` replaces the default end of the message."""
    found = protected_at(path)
    if found is None:
        return
    relation, what, folder = found
    if relation == "is" and what == allow:
        return
    fix = fix or ("choose another path" if relation == "is" else "write to a path outside it")
    raise error(f"{flag} {path} {relation} the {what} {folder}; {fix}")


def shown(folder: Path, names: list[str]) -> str:
    """Up to three of `names`, checkpoints, prepared datasets and exports first and named as such."""
    kinds = {n: kind_of(folder / n) or "" for n in names}
    listed = sorted(names, key=lambda n: (not kinds[n], kinds[n], n))[:3]
    parts: list[str] = []
    for kind in dict.fromkeys(kinds[n] for n in listed):
        group = [n for n in listed if kinds[n] == kind]
        plural = "s" if len(group) > 1 else ""
        parts.append(f"the {kind}{plural} {', '.join(group)}" if kind else ", ".join(group))
    return ", ".join(parts) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_folder_output(flag: str, output: Path, command: str, overwrite: bool, error: type[TitanError],
                        label: str, allow: str | None = None) -> None:
    """Refuse a folder `command` would write whole (replacing it with --overwrite) unless that loses nothing: a new
    path, or with --overwrite an earlier output of `command` holding only the files its marker lists.

    `label` names such an output in the message ("export", "seed checkpoint"); `allow` as in refuse_protected, for
    the command's own earlier output, which is a checkpoint (init-weights)."""
    ours = marker_files(output, command) if output.is_dir() else None
    refuse_protected(flag, output, error, allow=allow if ours is not None else None)
    if not output.exists() and not output.is_symlink():
        return
    if not overwrite:
        raise error(f"{flag} {output} already exists; remove it, choose another path or pass --overwrite")
    if not output.is_dir():
        raise error(f"{flag} {output} is a file; {command} writes a folder: remove the file or choose another path")
    theirs = sorted(p.name for p in output.iterdir() if ours is None or p.name not in ours)
    if theirs:
        what = f"is not an earlier {label}" if ours is None else f"holds files an earlier {label} did not write"
        raise error(f"{flag} {output} {what}; --overwrite would delete {shown(output, theirs)}: move them away or "
                    "choose another path")


def is_torch_archive(path: Path) -> bool:
    """True when `path` is a file torch.save wrote (a zip archive holding a pickled object)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def check_file_output(flag: str, output: Path, overwrite: bool, error: type[TitanError], label: str,
                      folder_hint: str, ours: Callable[[Path], bool] = is_torch_archive) -> None:
    """Refuse a file a command would write (replacing it with --overwrite) unless that loses nothing: a new path, or
    with --overwrite a file of the kind the command writes (`ours`), outside any checkpoint or prepared dataset.

    `folder_hint` ends the message when `output` is a folder (which name to give instead)."""
    refuse_protected(flag, output, error)
    if not output.exists() and not output.is_symlink():
        return
    if not overwrite:
        raise error(f"{flag} {output} already exists; remove it, choose another path or pass --overwrite")
    if output.is_dir():
        raise error(f"{flag} {output} {folder_hint}")
    if not ours(output):
        raise error(f"{flag} {output} is not an earlier {label}; --overwrite would replace {output.name}: move it "
                    "away or choose another path")


def refuse_foreign_names(flag: str, folder: Path, names: Iterable[str], ours: Callable[[str], bool],
                         error: type[TitanError], command: str, fix: str) -> None:
    """`error` naming the first of `names` that exists in `folder` but that `command` did not write (`ours` says),
    which writing there would replace; `fix` ends the message."""
    for name in names:
        path = folder / name
        if (path.exists() or path.is_symlink()) and not ours(name):
            raise error(f"{flag} {folder} holds {name}, which {command} did not write and would replace; {fix}")


def foreign_step_names(folder: Path) -> list[str]:
    """Entries of a checkpoint.dir named like a checkpoint (step-N) that are not one: a save of that step would
    replace them."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if _STEP_NAME.fullmatch(p.name) and not (p.is_dir() and is_checkpoint(p)))


def run_log_files_ours(folder: Path) -> Callable[[str], bool]:
    """Which of RUN_LOG_FILES in a metrics.log_dir a training run wrote: those its marker lists (a file whose
    digest it recorded only while unchanged: a config.toml the user edited since is theirs), or all of them in the
    log dir of a run from before markers (its run_info.json says so)."""
    marker = read_marker(folder, "train")
    listed = {str(n) for n in marker["files"]} if marker else set()
    digests = marker.get("digests") if marker else None
    digests = digests if isinstance(digests, dict) else {}
    try:
        info = json.loads(read_regular_text(folder / "run_info.json"))
    except (OSError, ValueError):
        info = None
    if marker is None and isinstance(info, dict) and {"tokens_per_step", "layout", "flops_per_token"} <= info.keys():
        listed = set(RUN_LOG_FILES)

    def ours(name: str) -> bool:
        if name not in listed:
            return False
        try:
            return name not in digests or file_digest(folder / name) == digests[name]
        except OSError:
            return False

    return ours

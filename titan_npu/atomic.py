"""Atomic writes: a file or folder appears under its name complete or not at all, never half-written.

Everything is written under a temporary name beside the target (`.<name>.<random>.tmp`: hidden, unique per writer,
and ending in `.tmp` like every unfinished file the project leaves), flushed to disk, then renamed onto the target;
the parent folder is flushed after the rename. A failure before the rename removes the temporary and leaves the
previous target as it was. The result keeps the permissions of the file it replaces; a new one gets those the
umask gives any file the user writes. Imports only the standard library: any module may use it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
_ATTEMPTS = 100


def _beside(target: Path, suffix: str, create: Callable[[Path], None]) -> Path:
    """Create a new entry with a fresh hidden name next to `target` (never reusing one that exists)."""
    for _ in range(_ATTEMPTS):
        candidate = target.parent / f".{target.name}.{secrets.token_hex(4)}{suffix}"
        try:
            create(candidate)
        except FileExistsError:
            continue
        except OSError as e:  # no space, read-only, permission denied: said of the target, not the hidden name
            raise OSError(e.errno, e.strerror, str(target)) from e
        return candidate
    raise FileExistsError(f"no free temporary name beside {target} after {_ATTEMPTS} tries; "
                          f"remove the stale .{target.name}.*{suffix} entries there")


def _create_file(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # mode 0o666 & ~umask, as open() gives


LOW_SPACE_BYTES = 1 << 20  # a write that failed on a filesystem with less free than this ran out of space
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # errors only a write meets


def as_os_error(error: BaseException, target: str | os.PathLike[str]) -> BaseException:
    """The error a write to `target` raised, as an OSError naming `target` where the writer did not say which
    file, or that the disk was full: torch.save and safetensors raise RuntimeError ("file write failed"), numpy
    an OSError with no errno ("8192 written"), a plain write OSError(ENOSPC) with no file name, torch's
    distributed checkpoint any of these inside a CheckpointException. Any other error is returned as it is."""
    target = Path(target)
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException: per rank
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, its stack)
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            translated = as_os_error(inner, target)
            return translated if isinstance(translated, OSError) else error
    if isinstance(error, OSError) and error.errno is not None:
        if error.filename is None and error.errno in _WRITE_ERRNOS:
            return OSError(error.errno, error.strerror, str(target))
        return error
    if not isinstance(error, (OSError, RuntimeError)) and type(error).__name__ != "SafetensorError":
        return error  # the writer's own refusal (a TitanError), not the filesystem's
    try:
        stat = os.statvfs(target.parent)
        full = stat.f_bavail * stat.f_frsize < LOW_SPACE_BYTES
    except OSError:
        full = False
    if full or "No space left on device" in str(error):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    return error


def _mode(target: Path, created: int) -> int:
    """The permission bits the result takes: those of the target it replaces, else `created` (the umask's)."""
    try:
        return target.stat().st_mode & 0o777
    except FileNotFoundError:
        return created


def _fsync(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a folder's contents to disk (a folder: its entries); skipped where the platform refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary file beside `path` to write; renamed onto `path` when the block succeeds, removed
    when it raises."""
    target = Path(path)
    tmp = _beside(target, TMP_SUFFIX, _create_file)
    try:
        created = tmp.stat().st_mode & 0o777
        yield tmp
        _fsync(tmp)
        os.chmod(tmp, _mode(target, created))  # also when the writer replaced the temporary with a private file
        os.replace(tmp, target)
    except BaseException as e:
        translated = as_os_error(e, target)  # before the temporary goes: it may be what filled the disk
        tmp.unlink(missing_ok=True)
        if translated is e:
            raise
        raise translated from e
    _fsync(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the file at `path` by `data` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Replace the file at `path` by `text` atomically."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 1,
                      default: Callable[[Any], Any] | None = None) -> None:
    """Replace the file at `path` by `obj` as JSON (one trailing newline) atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=default) + "\n")


def _fsync_tree(root: Path) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            file = os.path.join(folder, name)
            if os.path.isfile(file) and not os.path.islink(file):  # a fifo would block the open
                _fsync(file)
        _fsync(folder)


def replace_dir(source: Path, target: Path, aside: Path) -> None:
    """Rename the folder `source` to `target`. An existing `target` is first renamed to `aside` (a free name) and
    deleted once the new folder holds its name, or put back if that rename fails: `target` is never half of either."""
    if not os.path.lexists(target):
        os.replace(source, target)
        _fsync(target.parent)
        return
    os.replace(target, aside)
    try:
        os.replace(source, target)
    except BaseException:
        os.replace(aside, target)
        raise
    _fsync(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path` to fill; when the block succeeds its files are flushed and it
    takes the place of `path` (an existing folder there stays until then), when it raises it is removed."""
    target = Path(path)
    tmp = _beside(target, TMP_SUFFIX, lambda p: p.mkdir(0o777))
    try:
        created = tmp.stat().st_mode & 0o777
        yield tmp
        _fsync_tree(tmp)
        os.chmod(tmp, _mode(target, created))
        replace_dir(tmp, target, target.parent / f".{target.name}.{secrets.token_hex(4)}{OLD_SUFFIX}")
    except BaseException as e:
        translated = as_os_error(e, target)
        shutil.rmtree(tmp, ignore_errors=True)
        if translated is e:
            raise
        raise translated from e

"""One run at a time per checkpoint directory: a lock that the kernel releases when its owner dies.

Rank 0 holds a POSIX record lock (fcntl F_SETLK) on `<checkpoint.dir>/.titan-npu.lock` for the run's life and writes
its owner (host, pid, start time, torchrun job id and restart) into the file. A second run on the directory finds the
lock taken and is refused in one line naming that owner. The kernel drops the lock when the owning process exits in
any way (kill -9 included), so a crash never leaves it stuck; the file itself may stay behind, unlocked, and the next
run takes it over. A POSIX lock belongs to the process, not to its forked children (data-loader workers never hold
it), and is also what NFS locks across nodes (NLM / NFSv4): there, a node that dies holds it until the server's
lease runs out (about 90 s), which the restarted attempt of the same torchrun job waits for.

A POSIX lock is dropped when its process closes any descriptor of the file: the owner never opens the lock file
again (read_owner and current_owner are for other processes; current_owner checks this process's locks first).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from titan_npu.errors import CheckpointError

LOCK_FILE = ".titan-npu.lock"
# How long the restarted attempt of the job that owns the lock waits for its previous attempt's lock to go.
RESTART_WAIT_S = 120.0
_POLL_S = 0.2
_FLOCK = "@hhqqi4x"  # Linux's struct flock (x86_64, aarch64)

_held: dict[str, DirLock] = {}  # this process's locks by directory: a POSIX lock is per process, not per file


class DirLock:
    """This process's lock on one checkpoint directory; release() (or the process's end) gives it up."""

    def __init__(self, root: Path, fd: int, created: list[Path]) -> None:
        self.root = root
        self.fd = fd
        self.created = created  # the folders acquire() made, deepest first
        self.users = 1

    def release(self) -> None:
        """Give the lock up; the lock file goes, and the directory too when this run created it and left it empty."""
        self.users -= 1
        if self.users > 0 or self.fd < 0:
            return
        _held.pop(str(self.root), None)
        try:
            (self.root / LOCK_FILE).unlink()  # while still locked: a waiting run then retries on a fresh file
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        _remove_empty(self.created)  # a refused or checkpoint-less run leaves no folder behind


def owner_record() -> dict[str, Any]:
    """Who this process is, as written into the lock file."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "rendezvous": _rendezvous()}


def _rendezvous() -> str:
    """The address the ranks of this process's job meet at (MASTER_ADDR:MASTER_PORT, set for every rank by torchrun
    and by any launcher), "" for a single process: two jobs cannot hold one port at once."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{addr}:{port}" if addr and port and os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""


def acquire(root: str | Path) -> DirLock:
    """Take the lock of checkpoint directory `root` (creating it), or raise a CheckpointError naming the owner."""
    root = Path(root).expanduser().absolute()
    held = _held.get(str(root))
    if held is not None:
        held.users += 1
        return held
    created = [p for p in (root, *root.parents) if not p.exists()]
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir={root} cannot be created ({e.strerror or e}); choose another "
                              "--checkpoint.dir") from e
    me = owner_record()
    deadline = None
    while True:
        fd = _open_locked(root)
        if fd is not None:
            break
        owner = read_owner(root)
        if not _same_job(owner, me):
            raise _in_use(root, owner)
        # The restarted attempt of the same torchrun job: its previous attempt's lock goes when that process does.
        deadline = deadline or time.monotonic() + RESTART_WAIT_S
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint.dir={root} is still locked by this job's previous attempt ({describe_owner(owner)}) "
                f"after {RESTART_WAIT_S:.0f}s; stop that process, then restart"
            )
        time.sleep(_POLL_S)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    lock = DirLock(root, fd, created)
    _held[str(root)] = lock
    atexit.register(lock.release)
    return lock


def _open_locked(root: Path) -> int | None:
    """An fd of the lock file holding its lock, or None when another process holds it."""
    path = root / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                return None
            raise CheckpointError(f"cannot lock {path} ({e.strerror or e}); the filesystem of checkpoint.dir does "
                                  "not support file locks: choose a local or NFS folder") from e
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the owner released and removed this file meanwhile: lock the new one


def read_owner(root: str | Path) -> dict[str, Any]:
    """The owner record in the lock file ({} when unreadable or not yet written)."""
    try:
        owner = json.loads((Path(root) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def current_owner(root: str | Path) -> dict[str, Any] | None:
    """The owner record when another process holds the lock of checkpoint directory `root`, else None.

    Asks the kernel (F_GETLK) without taking the lock, so that any number of processes may ask at once; creates
    nothing. Linux only (elsewhere None: acquire() still refuses).
    """
    root = Path(root).expanduser().absolute()
    if str(root) in _held or not sys.platform.startswith("linux"):
        return None  # this process owns it (and must not open the file again), or no struct flock layout known
    try:
        fd = os.open(root / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: nobody holds it
    try:
        # struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        l_type, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    except OSError:
        return None
    finally:
        os.close(fd)
    if l_type == fcntl.F_UNLCK:
        return None
    return read_owner(root) or {"pid": pid}


def refuse_if_owned(root: str | Path) -> None:
    """Before a run builds anything: refuse checkpoint.dir when another run owns it (one line naming the owner).

    The restarted attempt of the owner's own torchrun job is let through (acquire() waits for its predecessor),
    and so is a rank whose own job's rank 0 already holds the lock (it may start first).
    """
    owner = current_owner(root)
    me = owner_record()
    if owner is not None and not _same_job(owner, me) and not _peer(owner, me):
        raise _in_use(Path(root).expanduser().absolute(), owner)


def _same_job(owner: dict[str, Any], me: dict[str, Any]) -> bool:
    """`me` is a later attempt of the torchrun job that `owner` belongs to."""
    return bool(me["job"]) and owner.get("job") == me["job"] and int(owner.get("restart", 0) or 0) < me["restart"]


def _peer(owner: dict[str, Any], me: dict[str, Any]) -> bool:
    """`owner` is rank 0 of this very attempt of this process's job (it took the lock while this rank starts)."""
    return bool(me["rendezvous"]) and owner.get("rendezvous") == me["rendezvous"] and owner.get("job") == me["job"] \
        and int(owner.get("restart", 0) or 0) == me["restart"]


def _in_use(root: Path, owner: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"checkpoint.dir={root} is in use by another run ({describe_owner(owner)}); wait for it "
                           "to end or stop it, or give this run another --checkpoint.dir")


def describe_owner(owner: dict[str, Any]) -> str:
    """'pid 123 on host h since 2026-...' (or what is known of it)."""
    if not owner.get("pid"):
        return "owner starting, not yet recorded"
    return f"pid {owner['pid']} on host {owner.get('host', '?')} since {owner.get('since', '?')}"


def _remove_empty(folders: list[Path]) -> None:
    """Remove these folders, deepest first, while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return

"""An operating-system error (no space, permission denied, read-only filesystem, ...) as one line for a person:
the file it happened on, the system's reason, and what to do about it (by errno)."""

from __future__ import annotations

import errno
import os
import re

# errno -> what to do; the line already names the file and the system's reason.
_FIX = {
    errno.ENOSPC: "free space on that filesystem (df -h) or choose a folder on another one",
    errno.EDQUOT: "your disk quota is used up: free space or choose a folder on another filesystem",
    errno.EROFS: "that filesystem is read-only: choose a folder on a writable one",
    errno.EACCES: "check its permissions and owner (ls -l), or choose another folder",
    errno.EPERM: "check its permissions and owner (ls -l), or choose another folder",
    errno.EISDIR: "it is a folder: give the path of a file",
    errno.ENOTDIR: "a part of that path is a file, not a folder: correct the path",
    errno.ENOENT: "check the path (it, or a folder on the way to it, does not exist)",
    errno.EEXIST: "it is already there: remove it or choose another path",
    errno.ENOTEMPTY: "the folder is not empty: choose another path",
    errno.ENAMETOOLONG: "the name is too long for the filesystem: choose a shorter path",
    errno.ELOOP: "a symbolic link on the way loops: correct the link or the path",
    errno.EMFILE: "this process has too many open files: raise the limit (ulimit -n) or lower data.num_workers",
    errno.ENFILE: "the system has too many open files: close other programs or raise fs.file-max",
    errno.EIO: "the disk or network filesystem failed to read or write it: check the device (dmesg), then "
               "retry or copy the data to a healthy disk",
    errno.EBUSY: "it is in use by another process or mount: stop that process or choose another path",
    errno.ETXTBSY: "it is in use by another process: stop that process or choose another path",
    errno.EXDEV: "the source and the destination are on different filesystems: keep them on one",
    errno.ENXIO: "it is a device or pipe with nothing on the other end: give a regular file",
    errno.ENOMEM: "the system is out of memory: free memory, or use fewer data workers / a smaller batch",
    errno.EFBIG: "the file is larger than the filesystem allows: choose another filesystem or smaller shards",
    errno.ESTALE: "the network filesystem's handle went stale: remount it or retry",
    errno.EPIPE: "what read this command's output stopped reading it (a pipe into head?)",
}
_DEFAULT_FIX = "check the path, its permissions and the filesystem"
# `RuntimeError: ... [Errno 13] Permission denied: '/x'` as a worker process re-raises it (DataLoader) or as a
# library words it: errno, reason, file.
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:\n]+)(?:: '([^'\n]*)')?(?: -> '([^'\n]*)')?")


def fix_for(code: int | None) -> str:
    """What to do about an OS error of errno `code` (a general advice for an unknown one)."""
    return _FIX.get(code, _DEFAULT_FIX) if code is not None else _DEFAULT_FIX


def describe_os_error(error: OSError) -> str:
    """One line: '<reason> (<errno name>): <file> [-> <file2>]; <fix>'."""
    code, reason = error.errno, error.strerror
    files = [f for f in (error.filename, error.filename2) if f is not None]
    if code is None:  # an OSError re-raised with a message only (a DataLoader worker's): find the errno in it
        found = _ERRNO_TEXT.search(str(error))
        if found:
            code, reason = int(found.group(1)), found.group(2)
            files = [f for f in found.group(3, 4) if f is not None]
        else:
            text = str(error).strip().splitlines()
            return f"{text[-1] if text else type(error).__name__}; {_DEFAULT_FIX}"
    reason = reason or os.strerror(code)
    name = errno.errorcode.get(code, str(code))
    where = " -> ".join(os.fsdecode(f) if isinstance(f, bytes) else str(f) for f in files)
    on = f": {where}" if where else ""
    return f"{reason} ({name}){on}; {fix_for(code)}"

"""Reading a file that a person named, which may be no file at all: a FIFO, a device or a socket is refused at once,
never opened in a way that blocks (a FIFO without a writer) or reads without end (/dev/zero).

Imports only the standard library: any module may use it. NotRegularFile is an OSError, so a caller's existing
`except OSError` (a file that cannot be read) covers it too.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


class NotRegularFile(OSError):
    """The path is a FIFO, a device, a socket or a folder: reading it could block or never end."""

    def __init__(self, path: str | os.PathLike[str], mode: int):
        self.kind = kind_of(mode)
        self.mode = mode
        super().__init__(errno.EINVAL, f"{self.kind}, not a regular file", os.fspath(path))


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for binary reading; NotRegularFile at once when it is not a regular file, OSError as the OS
    raises it. The open never blocks: O_NONBLOCK lets a FIFO without a writer open, and fstat then refuses it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | os.PathLike[str]) -> bytes:
    """The whole of a regular file; NotRegularFile or OSError otherwise (see open_regular)."""
    with open_regular(path) as f:
        return f.read()


def read_regular_text(path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    """A regular file's text (UnicodeDecodeError as bytes.decode raises it); see read_regular_bytes."""
    return read_regular_bytes(path).decode(encoding)




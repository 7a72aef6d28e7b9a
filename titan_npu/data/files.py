"""The data path's files: opened only when regular (never a blocking open of a FIFO or a device), OS errors as one
line naming the file, and content digests whose cost is bounded whatever the file's size.

A digest reads the whole file when it is at most FULL_DIGEST_BYTES, else DIGEST_BLOCKS blocks of DIGEST_BLOCK_BYTES
spread evenly from its first byte to its last (head and tail included), plus its size. A rewrite of a large file
that keeps its size is caught when it changes any sampled block: any re-tokenisation, another corpus or another
tokenizer does; an edit of a few bytes between the samples is not, which is why the loader also checks every batch
it hands out against the model's vocabulary (loader.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from titan_npu.errors import DataError
from titan_npu.os_errors import fix_for
from titan_npu.regular_files import NotRegularFile, kind_of, open_regular

FULL_DIGEST_BYTES = 16 << 20
DIGEST_BLOCKS = 64
DIGEST_BLOCK_BYTES = 4096
DIGEST_SCHEME = f"blake2b-128/full<={FULL_DIGEST_BYTES}/{DIGEST_BLOCKS}x{DIGEST_BLOCK_BYTES}"

log = logging.getLogger("titan_npu")
_warned: set[str] = set()


def not_regular(path: Path | str, mode: int, fix: str = "") -> DataError:
    """The refusal of a data file that is a FIFO, a device or a socket: it could block or never end."""
    fix = fix or "give a regular file (copy a stream into a file first)"
    return DataError(f"{path} is {kind_of(mode)}, not a regular file; {fix}")


def os_error(path: Path | str, e: OSError, doing: str = "read", fix: str = "") -> DataError:
    """An OS error on a data file as one line: the file, what failed and why, and the fix (by errno unless given)."""
    why = e.strerror or type(e).__name__
    return DataError(f"cannot {doing} {path} ({why}); {fix or fix_for(e.errno)}")


def regular_stat(path: Path, fix: str = "") -> os.stat_result:
    """path's stat (following links) when it is a regular file; DataError otherwise (nothing is opened)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise os_error(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode, fix)
    return st


def open_input(path: Path, fix: str = "") -> BinaryIO:
    """path opened for binary reading; DataError, at once, when it is not a regular file or cannot be opened (the
    open never blocks: regular_files.open_regular)."""
    try:
        return open_regular(path)
    except NotRegularFile as e:
        raise not_regular(path, e.mode, fix) from None
    except OSError as e:
        raise os_error(path, e) from None


def read_bytes(path: Path, fix: str = "") -> bytes:
    """The whole of a (small) regular file; DataError for anything else or an OS error."""
    with open_input(path, fix) as f:
        try:
            return f.read()
        except OSError as e:
            raise os_error(path, e) from None


def content_digest(path: Path, extra: bytes = b"") -> str:
    """Digest of path's content (whole, or sampled blocks when large: see the module docstring) and `extra`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(extra)
    with open_input(path) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            h.update(size.to_bytes(8, "little"))
            if size <= FULL_DIGEST_BYTES:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            else:
                last = size - DIGEST_BLOCK_BYTES
                for i in range(DIGEST_BLOCKS):
                    f.seek(last * i // (DIGEST_BLOCKS - 1))
                    h.update(f.read(DIGEST_BLOCK_BYTES))
        except OSError as e:
            raise os_error(path, e) from None
    return h.hexdigest()


def sampled_blocks(path: Path, align: int = 1) -> bytes:
    """The blocks content_digest reads of a large file (the whole file when small), each cut to a multiple of
    align bytes: a bounded sample of its content."""
    with open_input(path) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size <= FULL_DIGEST_BYTES:
                return f.read()
            out = []
            last = size - DIGEST_BLOCK_BYTES
            for i in range(DIGEST_BLOCKS):
                f.seek(last * i // (DIGEST_BLOCKS - 1) // align * align)
                out.append(f.read(DIGEST_BLOCK_BYTES))
            return b"".join(out)
        except OSError as e:
            raise os_error(path, e) from None


def warn_once(message: str) -> None:
    """A warning line (once per process): something in the input was skipped or is checked less than it could be."""
    if message not in _warned:
        _warned.add(message)
        log.warning("warning: %s", message)


@dataclass
class BadRecords:
    """What to do with a malformed record: raise (default) or count it and carry on."""

    skip: bool = False
    hint: str = "fix or remove that record"
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def report(self, where: str, problem: str) -> None:
        if not self.skip:
            raise DataError(f"{where}: {problem}; {self.hint}")
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {problem}")

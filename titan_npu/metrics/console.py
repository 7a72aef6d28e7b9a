"""The 'titan_npu' logger on the console: rank 0 at INFO on stdout, other ranks only their warnings."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; other ranks only warnings, prefixed with their rank."""
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if rank == 0 else f"[rank{rank}] "
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    root = logging.getLogger("titan_npu")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False

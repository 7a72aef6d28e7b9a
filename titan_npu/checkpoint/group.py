"""The ranks of a job as checkpointing sees them: a gloo process group of its own, and what every rank learns over it.

DCP's saves and loads, and the decisions around them, run on this group: gloo is host-side and works beside
hccl/nccl, and on the default group the collectives of a background save would interleave with training's.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_npu.errors import CheckpointError


class CheckpointGroup:
    """This process's rank and world size, and the gloo group (None on one process) checkpoints use."""

    def __init__(self, timeout_s: float) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.pg = None
        if self.distributed and self.world_size > 1:
            self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def all_gather(self, mine: Any) -> list[Any]:
        """Every rank's `mine`, in rank order (collective)."""
        if self.pg is None:
            return [mine]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.pg)
        return everyone

    def agree(self, decide: Callable[[], Any], where: str | Path) -> Any:
        """Run `decide` on rank 0 and hand its result to every rank; if it raises, every rank raises CheckpointError.

        `where` (e.g. the checkpoint directory) prefixes the message of an error other than CheckpointError.
        """
        result: list[Any] = [None]
        if self.rank == 0:
            try:
                result[0] = ("ok", decide())
            except Exception as e:  # every rank raises it, none waits for a decision that never comes
                message = str(e) if isinstance(e, CheckpointError) else f"{where}: {type(e).__name__}: {e}"
                result[0] = ("error", message)
        if self.pg is not None:
            dist.broadcast_object_list(result, src=0, group=self.pg)
        kind, value = result[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    def first_failure(self, error: BaseException | None) -> tuple[int, str] | None:
        """Share every rank's outcome (collective): the first failed rank and its reason in one line, or None."""
        mine = None if error is None else f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        failed = [(rank, reason) for rank, reason in enumerate(self.all_gather(mine)) if reason is not None]
        return failed[0] if failed else None

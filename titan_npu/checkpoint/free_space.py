"""Free space before a checkpoint save: refuse the save (nothing written, older checkpoints untouched) when the disk
cannot hold one more checkpoint.

The size expected is that of the newest complete checkpoint in the directory when there is one (exact for every
save but the first), otherwise an estimate from the tensors to be saved: a sharded tensor counts its global size
once across the ranks holding it, a plain tensor counts on every rank (an over-estimate for replicated training,
which only makes the first check stricter). Every rank checks the filesystem it writes to and all ranks agree.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.checkpoint import storage
from titan_npu.errors import CheckpointError

GB = 1e9


def free_bytes(path: str | Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def directory_bytes(path: str | Path) -> int:
    """Total size of the files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _tensor_share(t: torch.Tensor) -> int:
    """Bytes this rank contributes to a checkpoint for `t` (a DTensor's global size split over its mesh)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return t.numel() * t.element_size() // max(t.device_mesh.size(), 1)
    return t.numel() * t.element_size()


def state_bytes(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """This rank's share of the model and optimizer tensors a checkpoint holds."""
    total = 0
    for part in model_parts:
        total += sum(_tensor_share(t) for t in part.state_dict().values() if isinstance(t, torch.Tensor))
    for opt in optimizers:
        for per_param in opt.state.values():
            total += sum(_tensor_share(t) for t in per_param.values() if isinstance(t, torch.Tensor))
    return total


def expected_checkpoint_bytes(root: str | Path, model_parts: list[nn.Module], optimizers: list[Any],
                              group: Any = None) -> int:
    """Size of the next checkpoint: the newest complete one on disk, else the estimate (collective on `group`)."""
    latest = storage.latest_checkpoint(root)
    measured = directory_bytes(latest.path) if latest is not None else 0
    estimate = torch.tensor([state_bytes(model_parts, optimizers)], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(estimate, group=group)
        # Ranks may see different filesystems (per-node disks): take the largest measurement of any of them.
        seen = torch.tensor([measured], dtype=torch.float64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        measured = int(seen.item())
    return measured if measured > 0 else int(estimate.item())


def check_free_space(root: str | Path, model_parts: list[nn.Module], optimizers: list[Any], margin: float,
                     group: Any = None) -> None:
    """Raise CheckpointError on every rank when any rank's disk has less than margin x the expected size free."""
    need = int(margin * expected_checkpoint_bytes(root, model_parts, optimizers, group))
    mine = [free_bytes(root), socket.gethostname()]
    everyone = [mine]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    short = [(rank, free, host) for rank, (free, host) in enumerate(everyone) if free < need]
    if not short:
        return
    rank, free, host = short[0]
    raise CheckpointError(
        f"not enough free space for a checkpoint in {root} (rank {rank} on {host}): {free / GB:.2f} GB free, "
        f"{need / GB:.2f} GB needed (one checkpoint x reliability.disk_margin); free space or lower "
        f"checkpoint.keep_last_n; {storage.latest_checkpoint_note(root)}"
    )

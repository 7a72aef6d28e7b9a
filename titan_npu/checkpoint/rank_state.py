"""What differs per rank and is not a tensor of the model: the data loader's position and the RNG states.

Each rank writes `ranks/rank-R.pt` into the checkpoint (plain ints, strings and tensors, read back with
torch.load(weights_only=True)). On resume a rank reads its own file when the world size is unchanged; under a new
layout it reads a file of a rank with the same data-parallel coordinate, or dp rank 0's when the dp size changed.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_npu.errors import CheckpointError

RANKS_DIR = "ranks"


def rank_file(checkpoint: str | Path, rank: int) -> Path:
    """Path of one rank's state inside a checkpoint."""
    return Path(checkpoint) / RANKS_DIR / f"rank-{rank}.pt"


def capture_rng(device_type: str) -> dict[str, Any]:
    """Every random generator a training step may touch: torch (CPU and device), Python, NumPy."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_state_to_plain(random.getstate()),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    mod = None if device_type == "cpu" else getattr(torch, device_type, None)
    if mod is not None and hasattr(mod, "get_rng_state"):
        state["device"] = mod.get_rng_state()
    return state


def restore_rng(state: dict[str, Any], device_type: str) -> None:
    """Put the generators back to what capture_rng saw."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    mod = None if device_type == "cpu" else getattr(torch, device_type, None)
    if "device" in state and mod is not None and hasattr(mod, "set_rng_state"):
        mod.set_rng_state(state["device"])


def _python_state_to_plain(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def write_rank_state(checkpoint: str | Path, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's state file (flushed to disk before the checkpoint can be published)."""
    path = rank_file(checkpoint, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def read_rank_state(checkpoint: str | Path, rank: int) -> dict[str, Any]:
    """Read one rank's state file, tensors and plain values only."""
    path = rank_file(checkpoint, rank)
    from titan_npu.checkpoint.dcp_io import damaged, one_line

    if not path.is_file():
        raise damaged(Path(checkpoint), f"{path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's weights_only refusal runs to a dozen lines: keep its first
        raise damaged(Path(checkpoint), f"{path} is unreadable ({type(e).__name__}: {one_line(e)})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a rank state (found {type(state).__name__})")
    return state


def pick_source_rank(saved: list[dict[str, int]], rank: int, dp_rank: int, dp_degree: int) -> int:
    """Which saved rank's file this rank restores from (`saved`: per saved rank, its dp_rank and dp_degree).

    Its own when it exists with the same data-parallel coordinates; else the first saved rank with them; else the
    first saved rank of dp rank 0 (the loader's position is global, so it continues at the same window).
    """
    def same(r: int) -> bool:
        return saved[r]["dp_degree"] == dp_degree and saved[r]["dp_rank"] == dp_rank

    if rank < len(saved) and same(rank):
        return rank
    matching = [r for r in range(len(saved)) if same(r)]
    if matching:
        return matching[0]
    return next(r for r, s in enumerate(saved) if s["dp_rank"] == 0)

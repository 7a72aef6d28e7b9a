"""Start a run from full (unsharded) weights: our exported .pt, on any parallel layout."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from titan_npu.errors import CheckpointError


def read_full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a full model state dict from a .pt file (tensors only, never arbitrary objects)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint.initial_load={str(path)!r} is not a file; give a .pt written by "
                              "`titan-npu export --format pt`")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable tensor file ({type(e).__name__}: {e})") from e
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: expected a state dict (name -> tensor), found {type(sd).__name__}")
    return sd


def describe_mismatch(expected: dict[str, torch.Size], given: dict[str, torch.Tensor]) -> str | None:
    """A one-line description of missing / unexpected keys and shape mismatches, or None when they fit."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(given[k].shape)} vs model {tuple(expected[k])}"
              for k in expected if k in given and tuple(given[k].shape) != tuple(expected[k])]
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    if shapes:
        parts.append(f"{len(shapes)} shape mismatches (e.g. {shapes[0]})")
    hint = "the checkpoint is for another model size" if shapes else (
        "the checkpoint is in another format (Hugging Face names? use `titan-npu import`)"
        if any(k.startswith("model.") for k in unexpected) else "the checkpoint is for another model layout")
    return "; ".join(parts) + f" -- likely {hint}"


def load_initial_weights(model: nn.Module, path: str | Path, model_args=None) -> None:
    """Load full weights into a (possibly FSDP/TP-sharded) model; every rank reads the file (mmap)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = read_full_state_dict(path)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    problem = describe_mismatch(expected, sd)
    if problem:
        raise CheckpointError(f"{path} does not fit the model: {problem}")
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=True))

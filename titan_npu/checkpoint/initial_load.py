"""Start a run from pretrained weights (checkpoint.initial_load), on any parallel layout.

Accepted: a Hugging Face model directory (any model_type of models/registry.py), Meta's consolidated.*.pth (or
their directory), a full .pt from `titan-npu export --format pt` / `titan-npu import`, and a checkpoint step-N
directory of ours. A safetensors Hugging Face directory is read shard-wise: each rank reads only the slices of each
tensor it holds (hf_slices.py) and the log states the bytes each rank read. Other full weights (.bin, Meta, .pt)
are read by every rank (memory-mapped where the format allows) and each rank keeps its shard; a step-N directory
is read shard-wise through DCP.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.checkpoint.fit import describe_mismatch
from titan_npu.checkpoint.formats import Weights, detect_format, hf_model, read_weights
from titan_npu.checkpoint.hf_slices import load_hf_slices, meta_state_dict, read_volume_line, safetensors_tensors
from titan_npu.errors import CheckpointError
from titan_npu.lora.names import is_adapter_name
from titan_npu.models.registry import build_model

log = logging.getLogger("titan_npu")


def read_full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Full model weights under our names from any supported format."""
    return read_weights(path).state_dict


def full_model_shapes(args: Any) -> dict[str, torch.Size]:
    """Every parameter of the whole model (all pipeline stages) and its shape, without allocating it."""
    with torch.device("meta"):
        model = build_model(args)
    return {k: v.shape for k, v in model.state_dict().items()}


def check_args_match(weights: Weights, model_args: Any) -> None:
    """Refuse weights whose head layout differs from the model's: same shapes, different function."""
    ckpt = weights.args
    if ckpt is None or model_args is None:
        return
    diffs = [f"{name} {getattr(ckpt, name)} vs {getattr(model_args, name)}"
             for name in ("n_heads", "n_kv_heads") if getattr(ckpt, name) != getattr(model_args, name)]
    if diffs:
        raise CheckpointError(
            f"{weights.source} was trained with other attention heads than [model] ({', '.join(diffs)}; checkpoint "
            f"vs config); set model.n_heads={ckpt.n_heads} and model.n_kv_heads={ckpt.n_kv_heads}"
        )
    for name in ("rope_theta", "norm_eps", "rope_scaling_factor"):
        if getattr(ckpt, name) != getattr(model_args, name):
            log.warning("initial_load: %s is %s in %s but %s in [model]; the model computes a different function "
                        "than the one trained", name, getattr(ckpt, name), weights.source, getattr(model_args, name))


def load_initial_weights(
    model: nn.Module | list[nn.Module],
    path: str | Path,
    model_args: Any = None,
    model_only: bool = True,
    manager: Any = None,
) -> None:
    """Load pretrained weights into a (possibly FSDP/TP-sharded or pipeline-split) model; collective.

    model_only=False is for step-N checkpoints only and also restores the optimizer state (needs `manager`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    parts = model if isinstance(model, list) else [model]
    kind = detect_format(path)
    if kind == "dcp":
        if manager is None:
            raise CheckpointError(f"{path} is a step-N checkpoint; load it through CheckpointManager")
        manager.load_checkpoint(path, sections=("model",) if model_only else ("model", "optimizer"))
        return
    if not model_only:
        raise CheckpointError(
            f"checkpoint.initial_load={path} is {kind} weights, which hold no optimizer state; set "
            "checkpoint.initial_load_model_only=true (or point initial_load at a step-N checkpoint)"
        )
    if kind == "hf":
        tensors = safetensors_tensors(Path(path)) if hf_model(Path(path))[0].hf.shard_wise else None
        if tensors is not None:
            _load_hf_shard_wise(parts, Path(path), tensors, model_args)
            return
    weights = read_weights(path)
    if weights.note:
        log.info("initial_load: %s", weights.note)
    _check_fit(weights, parts, model_args)
    for part in parts:
        own = part.state_dict()
        # Cast here: the model keeps its own (fp32 master) dtype whatever the file stores. LoRA's adapters are not
        # in pretrained weights: they keep their initial values.
        subset = {k: weights.state_dict[k].to(own[k].dtype) for k in own if not is_adapter_name(k)}
        set_model_state_dict(part, subset, options=StateDictOptions(full_state_dict=True,
                                                                    strict=len(subset) == len(own)))
    log.info("initial_load: loaded %s weights from %s (%d tensors)", kind, path, len(weights.state_dict))


def _check_fit(weights: Weights, parts: list[nn.Module], model_args: Any) -> None:
    """Refuse weights whose heads, names or shapes differ from the model's (a CheckpointError saying which)."""
    check_args_match(weights, model_args)
    expected = full_model_shapes(model_args) if model_args is not None else {
        k: v.shape for part in parts for k, v in part.state_dict().items()}
    problem = describe_mismatch(expected, weights.state_dict, model_args)
    if problem:
        raise CheckpointError(f"checkpoint.initial_load={weights.source} does not fit the model: {problem}")


def _load_hf_shard_wise(parts: list[nn.Module], path: Path, tensors: dict, model_args: Any) -> None:
    """Fill each rank's shards from a safetensors Hugging Face directory, reading only them; logs the volume."""
    spec, args, tied = hf_model(path)
    found, args, note = meta_state_dict(tensors, spec, args, tied)
    if note:
        log.info("initial_load: %s", note)
    _check_fit(Weights(found, args, "hf", path, note), parts, model_args)
    mine = load_hf_slices(parts, tensors, spec, args, tied)
    full = sum(file.stat().st_size for file in {t.file for t in tensors.values()})
    log.info("initial_load: this rank read %d of the %d bytes of %s", mine, full, path)
    per_rank = _gather_counts(mine)
    if len(per_rank) == 1 or dist.get_rank() == 0:
        log.info(read_volume_line(per_rank, full, path))


def _gather_counts(mine: int) -> list[int]:
    """Every rank's `mine` (a host collective over the default group; just [mine] without one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.tensor([mine], dtype=torch.int64))
    return [int(count) for count in everyone]

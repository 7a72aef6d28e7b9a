"""Does a set of weights fit a model? Missing and unexpected keys, shape mismatches, and the likely cause; the model
holding weights that fit (load_model: what generate, eval and [eval] in a run evaluate)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from titan_npu.errors import CheckpointError
from titan_npu.models.registry import spec_of

_SHOWN = 3
_LAYER = re.compile(r"layers\.(\d+)\.")
# Prefixes that wrappers add to parameter names when a state dict is taken from the wrapper, not the model.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)


def _layer_count(keys: Sequence[str]) -> int:
    layers = {int(m.group(1)) for k in keys if (m := _LAYER.match(k))}
    return max(layers) + 1 if layers else 0


def _layer(key: str) -> int | None:
    match = _LAYER.match(key)
    return int(match.group(1)) if match else None


def _mtp_cause(missing: Sequence[str], unexpected: Sequence[str], expected_keys: Sequence[str],
               found_keys: Sequence[str], args: Any) -> str | None:
    """When every key out of place is a multi-token-prediction layer's (layers.{n_layers + k}, a model with
    blocks beyond n_layers, ModelSpec.extra_blocks): how many the checkpoint holds whole and the count
    that loads them; None otherwise."""
    extra = None if getattr(args, "family", None) is None else spec_of(args).extra_blocks(args)
    if extra is None:
        return None
    depth, key = extra
    if any((_layer(k) or 0) < args.n_layers for k in (*missing, *unexpected)):
        return None
    found = set(found_keys)
    if missing:
        held = 0
        while held < depth and all(k in found for k in expected_keys if _layer(k) == args.n_layers + held):
            held += 1
        whole = "whole "
    else:
        held, whole = _layer_count(found_keys) - args.n_layers, ""
    return (f"the checkpoint holds {held} {whole}multi-token-prediction layer(s) (layers.{args.n_layers} on), the "
            f"model {depth} (model.{key}): set model.{key}={held}")


def likely_cause(missing: Sequence[str], unexpected: Sequence[str], shape_diffs: Sequence[str],
                 expected_keys: Sequence[str], found_keys: Sequence[str], args: Any = None) -> str:
    """The most probable reason a checkpoint's keys do not match the model's (of `args`, when given), with what to do
    about it."""
    if any(k.startswith("model.") or k.startswith("lm_head.") for k in unexpected):
        return ("the weights use Hugging Face names: point checkpoint.initial_load at the Hugging Face directory "
                "or convert with `titan-npu import`")
    if any(k.startswith(p) for k in unexpected for p in _WRAPPER_PREFIXES):
        return "the state dict was taken from a wrapped model (torch.compile / DDP / FSDP1 / AC): strip the prefix"
    if any(".distcp" in k or k.startswith("__") for k in unexpected):
        return "this is a sharded (DCP) checkpoint: pass its directory, or `titan-npu export --format pt` it first"
    if shape_diffs:
        return "the checkpoint is for another model size: set [model] to the shapes it was trained with"
    mtp = _mtp_cause(missing, unexpected, expected_keys, found_keys, args)
    if mtp:
        return mtp
    found_layers, model_layers = _layer_count(found_keys), _layer_count(expected_keys)
    if found_layers != model_layers and found_layers and model_layers:
        return f"the checkpoint has {found_layers} layers, the model {model_layers}: set model.n_layers to match"
    if missing and not any(k in found_keys for k in expected_keys):
        return ("no key matches: the checkpoint is another format (sharded vs full, or not a Llama state dict); "
                "full weights go to checkpoint.initial_load, DCP directories to checkpoint.resume")
    return "the checkpoint was written for another model layout or version"


def describe_mismatch(expected: Mapping[str, Any], found: Mapping[str, Any], args: Any = None) -> str | None:
    """One line naming missing / unexpected keys (first few and counts), shape mismatches and the likely cause.

    Values are tensors or shapes; `args` (the model's, optional) sharpens the cause. None means the two fit.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [f"{k}: checkpoint {_shape(found[k])} vs model {_shape(expected[k])}"
              for k in expected if k in found and _shape(found[k]) != _shape(expected[k])]
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) (e.g. {', '.join(missing[:_SHOWN])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) (e.g. {', '.join(unexpected[:_SHOWN])})")
    if shapes:
        parts.append(f"{len(shapes)} shape mismatch(es) (e.g. {'; '.join(shapes[:2])})")
    cause = likely_cause(missing, unexpected, shapes, list(expected), list(found), args)
    return "; ".join(parts) + f" -- likely {cause}"


def load_model(state_dict: dict[str, torch.Tensor], args: Any, device: torch.device, dtype: torch.dtype
               ) -> nn.Module:
    """The model of `args` on `device` in `dtype`, holding `state_dict` (every key must fit), in eval mode."""
    from titan_npu.models.registry import build_model

    with torch.device("meta"):
        model = build_model(args)
    problem = describe_mismatch({k: v.shape for k, v in model.state_dict().items()}, state_dict)
    if problem:
        raise CheckpointError(f"the checkpoint does not fit the model ({args.dim=}, {args.n_layers=}): {problem}")
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.tie_weights()  # assign gave the output projection a parameter of its own
    # RoPE tables are not saved (still on meta): compute them, on the device and in fp32 whatever the weights' dtype.
    model.freqs_cos, model.freqs_sin = model.rope_tables("cpu")
    model.to(device=device, dtype=dtype)
    model.freqs_cos, model.freqs_sin = model.rope_tables(device)
    return model.eval()

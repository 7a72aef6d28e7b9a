"""Full (unsharded) weights in the formats people bring: Hugging Face, Meta consolidated, our .pt, DCP directories.

read_weights(path) returns our state dict (Meta names, e.g. layers.0.attention.wq.weight) and, when the source
says, the model's args (its family's, through models/registry.py: a Hugging Face config.json's model_type, a step-N
checkpoint's info). A Hugging Face directory's args are those of the model its weights fill: where config.json asks
for layers the weights lack (DeepSeek-V3's multi-token prediction), the args leave them out and `note` says so.
Files are read as tensors only: safetensors, or torch.load(weights_only=True).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_npu.checkpoint import storage
from titan_npu.errors import CheckpointError
from titan_npu.models.registry import args_from_dict, read_meta_checkpoint, spec_for_hf_config
from titan_npu.regular_files import read_regular_text

HF_INDEX = "model.safetensors.index.json"
HF_BIN_INDEX = "pytorch_model.bin.index.json"


@dataclass
class Weights:
    """A full state dict under our names, with the shapes it implies when its source states them."""

    state_dict: dict[str, torch.Tensor]
    args: Any | None  # the model's args (models/spec.py), when the source states them
    format: str  # hf | meta | pt | dcp
    source: Path
    note: str | None = None  # what the source's config asks for that its weights lack (one line), if anything


def detect_format(path: str | Path) -> str:
    """hf, meta, pt or dcp, from what the path holds; a CheckpointError that says what is there otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a Hugging Face model directory, a Meta consolidated.*.pth "
                              "(or its directory), a .pt from `titan-npu export`, or a checkpoint step-N directory")
    if path.is_file():
        if path.name.endswith(".distcp") or path.name == storage.DCP_METADATA:
            raise CheckpointError(f"{path} is one file of a sharded (DCP) checkpoint; pass its directory {path.parent}")
        if path.suffix == ".safetensors":
            raise CheckpointError(f"{path} is a bare .safetensors file; pass the directory that also holds config.json")
        if path.name.startswith("consolidated.") and (path.parent / "params.json").is_file():
            return "meta"
        return "pt"
    if (path / storage.DCP_METADATA).is_file():
        return "dcp"
    if (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file() or (path / HF_BIN_INDEX).is_file()
    ):
        return "hf"
    if (path / "params.json").is_file() and any(path.glob("consolidated.*.pth")):
        return "meta"
    if storage.list_checkpoints(path):
        latest = storage.latest_checkpoint(path)
        raise CheckpointError(f"{path} is a checkpoint directory; pass one checkpoint in it, e.g. {latest.path}")
    if path.name.endswith(storage.TMP_SUFFIX):
        raise CheckpointError(f"{path} is an incomplete checkpoint (its save did not finish); use an earlier one")
    raise CheckpointError(
        f"{path} holds no weights this tool reads: expected config.json + *.safetensors (Hugging Face), "
        "params.json + consolidated.*.pth (Meta), or a step-N checkpoint (.metadata)"
    )


def read_weights(path: str | Path, dtype: torch.dtype | None = None) -> Weights:
    """Read full weights from any supported format into our names; dtype casts floating tensors (None keeps)."""
    path = Path(path)
    kind = detect_format(path)
    note = None
    if kind == "hf":
        state_dict, args, note = _read_hf(path)
    else:
        state_dict, args = {"meta": _read_meta, "pt": _read_pt, "dcp": _read_dcp}[kind](path)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    return Weights(state_dict, args, kind, path, note)


# ---------------------------------------------------------------- Hugging Face


def read_hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face config.json as a dict."""
    try:
        config = json.loads(read_regular_text(path / "config.json"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'} is not a JSON object")
    return config


def hf_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face directory (its index's, else every *.safetensors, else the .bin)."""
    for index_name in (HF_INDEX, HF_BIN_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a weight index ({type(e).__name__}: {e})") from e
            files = sorted({path / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists {len(missing)} missing file(s) (e.g. {missing[0]}); the "
                                      "download is incomplete")
            return files
    files = sorted(path.glob("*.safetensors"))
    return files or [path / "pytorch_model.bin"]


def read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory, under Hugging Face names."""
    tensors: dict[str, torch.Tensor] = {}
    for file in hf_files(path):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            try:
                tensors.update(load_file(str(file)))
            except Exception as e:
                raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from e
        else:
            tensors.update(_torch_load(file))
    return tensors


def hf_model(path: Path) -> tuple[Any, Any, bool]:
    """(family spec, args, tie_word_embeddings) of a Hugging Face directory, from its config.json."""
    config = read_hf_config(path)
    spec = spec_for_hf_config(config)
    return spec, spec.hf.args_from_config(config), bool(config.get("tie_word_embeddings", False))


def hf_state_dict(hf: dict[str, torch.Tensor], spec: Any, args: Any, tied: bool
                  ) -> tuple[dict[str, torch.Tensor], Any, str | None]:
    """Hugging Face tensors (or meta tensors of their shapes) -> ours, the args of the model they fill, and the line
    on what config.json asks for that they lack (None if nothing)."""
    return spec.hf.held_model(spec.hf.from_hf(hf, args, tie_word_embeddings=tied), args)


def _read_hf(path: Path) -> tuple[dict[str, torch.Tensor], Any, str | None]:
    spec, args, tied = hf_model(path)
    return hf_state_dict(read_hf_tensors(path), spec, args, tied)


# ---------------------------------------------------------------- Meta


def _read_meta(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    folder = path if path.is_dir() else path.parent
    shards = sorted(folder.glob("consolidated.*.pth")) if path.is_dir() else [path]
    try:
        params = json.loads(read_regular_text(folder / "params.json"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / 'params.json'} is unreadable ({type(e).__name__}: {e})") from e
    loaded = [_torch_load(f) for f in shards]
    if "tok_embeddings.weight" not in loaded[0]:
        raise CheckpointError(f"{shards[0]} has no tok_embeddings.weight; it is not a Meta Llama checkpoint")
    return read_meta_checkpoint(params, loaded)


# ---------------------------------------------------------------- ours


def _read_pt(path: Path) -> tuple[dict[str, torch.Tensor], None]:
    sd = _torch_load(path)
    if "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    sd = {k: v for k, v in sd.items() if k != "rope.freqs"}
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entries {bad[:3]} are not tensors; expected a model state dict "
                              "(`titan-npu export --format pt` writes one)")
    return sd, None


def _read_dcp(path: Path) -> tuple[dict[str, torch.Tensor], Any | None]:
    from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries

    if path.name.endswith(storage.TMP_SUFFIX) or not (path / storage.DCP_METADATA).is_file():
        storage.check_checkpoint_dir(path)
    metadata = read_metadata(path)
    prefix = "model." if tensor_entries(metadata, "model.") else ""
    keys = [prefix + k for k in tensor_entries(metadata, prefix) if prefix or not k.startswith("optimizer.")]
    tensors = load_tensors(path, metadata, keys)
    args = None
    info = storage.read_info(path) if (path / storage.INFO_FILE).is_file() else {}
    model_args = info.get("model_args")
    args = args_from_dict(model_args) if model_args else None
    state = {k[len(prefix):]: v for k, v in tensors.items()}
    if info.get("lora"):  # a LoRA run's: its model is the weights with the adapters merged
        from titan_npu.lora.peft import merge_adapters

        state = merge_adapters(state, info["lora"])
    return state, args


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        from titan_npu.checkpoint.dcp_io import one_line

        raise CheckpointError(
            f"{path} is not a tensor file torch.load(weights_only=True) accepts ({type(e).__name__}: "
            f"{one_line(e)}); checkpoints holding code or objects are refused"
        ) from e
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: expected a state dict (name -> tensor), found {type(sd).__name__}")
    return sd

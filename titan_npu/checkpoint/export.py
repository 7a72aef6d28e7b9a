"""Export a training checkpoint (DCP, any layout) to full weights: one .pt, or a Hugging Face directory.

Runs offline in one process, without the training setup: the model's tensors are read from the DCP files a few
layers at a time (never the optimizer state), cast, renamed, and written. Output appears under its final name only
when complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries
from titan_npu.data.tokenizer import BYTE_TOKENIZER_NAMES
from titan_npu.errors import CheckpointError
from titan_npu.models.llama.args import LlamaArgs

log = logging.getLogger("titan_npu")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_LAYER = re.compile(r"layers\.(\d+)\.")


def resolve_source(checkpoint: str | Path, step: int | None = None) -> storage.CheckpointRef:
    """A step-N directory, or a checkpoint.dir with --step N (default: its latest complete checkpoint)."""
    path = Path(checkpoint)
    if step is not None:
        if storage.is_complete(path):
            raise CheckpointError(f"--checkpoint {path} is already one checkpoint; drop --step or pass its parent")
        return storage.resolve_checkpoint(str(step), path)
    if not storage.is_complete(path) and path.is_dir() and not path.name.endswith(storage.TMP_SUFFIX):
        latest = storage.latest_checkpoint(path)
        if latest is not None:
            return latest
    storage.check_checkpoint_dir(path)
    return storage.CheckpointRef(storage.read_info(path)["step"], path)


def checkpoint_model_args(path: Path, info: dict | None = None) -> LlamaArgs:
    """The model shapes a checkpoint was trained with (from its checkpoint.json, or `info` already read from it)."""
    model_args = (storage.read_info(path) if info is None else info).get("model_args")
    if not model_args:
        raise CheckpointError(f"{path}/{storage.INFO_FILE} records no model shapes; cannot write a Hugging Face "
                              "config for it (export --format pt works)")
    return LlamaArgs(**model_args)


def _ordered_keys(keys: list[str]) -> list[str]:
    def order(key: str) -> tuple[int, int, str]:
        match = _LAYER.match(key)
        if key.startswith("tok_embeddings."):
            return (0, 0, key)
        if match:
            return (1, int(match.group(1)), key)
        return (2, 0, key)

    return sorted(keys, key=order)


def _groups(keys: list[str]) -> Iterator[list[str]]:
    """Keys in model order, one group per layer (and one per top-level tensor): a unit small enough to hold."""
    group: list[str] = []
    current = None
    for key in _ordered_keys(keys):
        match = _LAYER.match(key)
        unit = match.group(1) if match else key
        if group and unit != current:
            yield group
            group = []
        group.append(key)
        current = unit
    if group:
        yield group


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


# Files of a tokenizer directory that a Hugging Face directory carries beside the weights.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files(spec: str | None) -> list[Path]:
    """The tokenizer files to put beside exported weights: data.tokenizer's file, or the known files of its
    directory; [] for "byte" / none. A path that does not exist is a CheckpointError."""
    if not spec or spec == "none" or spec in BYTE_TOKENIZER_NAMES:
        return []
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = [path / name for name in HF_TOKENIZER_FILES if (path / name).is_file()]
        if found:
            return found
        raise CheckpointError(f"tokenizer directory {path} holds none of {', '.join(HF_TOKENIZER_FILES)}; pass "
                              "--tokenizer with the file, or --tokenizer none")
    raise CheckpointError(f"tokenizer {spec} does not exist (moved since training?); pass --tokenizer PATH, or "
                          "--tokenizer none to export the weights alone")


def _hf_tokenizer_name(f: Path) -> str:
    """The name a Hugging Face directory gives the file: a tokenizers JSON is tokenizer.json, a SentencePiece or
    tiktoken file tokenizer.model."""
    if f.name in HF_TOKENIZER_FILES:
        return f.name
    return {".json": "tokenizer.json", ".model": "tokenizer.model"}.get(f.suffix, f.name)


def export_checkpoint(
    source: str | Path,
    output: str | Path,
    fmt: str = "pt",
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    tokenizer: str | None = None,
) -> list[Path]:
    """Write a checkpoint's model weights as `fmt` (pt | hf) in `dtype` to `output`; returns the files written.

    For hf, the tokenizer's files (`tokenizer`, or by default the data.tokenizer the checkpoint records) are
    copied beside the weights.
    """
    source, output = Path(source), Path(output)
    if fmt not in ("pt", "hf"):
        raise CheckpointError(f"--format {fmt!r} is unknown; use pt (one full state dict file) or hf (Hugging Face)")
    storage.check_checkpoint_dir(source)
    if output.exists() and not overwrite:
        raise CheckpointError(f"--output {output} already exists; remove it, choose another path or pass --overwrite")
    if output.resolve() == source.resolve() or source.resolve() in output.resolve().parents:
        raise CheckpointError(f"--output {output} is inside the checkpoint {source}; write it elsewhere")
    metadata = read_metadata(source)
    model = tensor_entries(metadata, "model.")
    if not model:
        raise CheckpointError(f"{source} holds no model weights (no 'model.' entries); is it a titan-npu checkpoint?")
    if fmt == "pt":
        output.parent.mkdir(parents=True, exist_ok=True)
        return [_export_pt(source, metadata, list(model), output, dtype)]
    info = storage.read_info(source)
    args = checkpoint_model_args(source, info)
    extra = tokenizer_files(info.get("tokenizer") if tokenizer is None else tokenizer)
    output.parent.mkdir(parents=True, exist_ok=True)
    return _export_hf(source, metadata, model, output, dtype, args, max_shard_bytes, extra)


def _load_group(source: Path, metadata, keys: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = load_tensors(source, metadata, [f"model.{k}" for k in keys])
    return {k: tensors[f"model.{k}"].to(dtype) for k in keys}


def _export_pt(source: Path, metadata, keys: list[str], output: Path, dtype: torch.dtype) -> Path:
    state: dict[str, torch.Tensor] = {}
    for group in _groups(keys):
        state.update(_load_group(source, metadata, group, dtype))
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if output.is_dir():
            shutil.rmtree(output)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return output


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split keys (in model order) into consecutive shards of at most max_shard_bytes (a bigger tensor: alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for key in _ordered_keys(list(sizes)):
        if shards[-1] and used + sizes[key] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += sizes[key]
    return shards


def _export_hf(source: Path, metadata, model: dict, output: Path, dtype: torch.dtype, args: LlamaArgs,
               max_shard_bytes: int, tokenizer: list[Path]) -> list[Path]:
    from safetensors.torch import save_file

    from titan_npu.models.llama.state_dict_adapter import hf_config, to_hf

    sizes = {k: _nbytes(tuple(meta.size), dtype) for k, meta in model.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp"))
    try:
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        weight_map: dict[str, str] = {}
        for name, keys in zip(names, shards):
            hf = to_hf(_load_group(source, metadata, keys, dtype), args)
            save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in hf})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = {**hf_config(args), "torch_dtype": HF_DTYPE_NAMES[dtype]}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in tokenizer:
            shutil.copyfile(f, tmp / _hf_tokenizer_name(f))
        if output.exists():
            shutil.rmtree(output) if output.is_dir() else output.unlink()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(output.iterdir())

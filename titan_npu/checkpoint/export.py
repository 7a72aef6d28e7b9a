"""Export a training checkpoint (DCP, any layout) to full weights: one .pt, or a Hugging Face directory.

Runs offline in one process, without the training setup: the model's tensors are read from the DCP files a few
layers at a time (never the optimizer state), cast, renamed, and written. Output appears under its final name only
when complete, with the permissions the umask gives. A Hugging Face export carries a marker file listing what it
wrote: `--overwrite` replaces only such a folder, never a checkpoint or a folder of the user's own files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from titan_npu import outputs
from titan_npu.atomic import atomic_dir, atomic_path
from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries
from titan_npu.data.tokenizer import BYTE_TOKENIZER_NAMES
from titan_npu.errors import CheckpointError
from titan_npu.models.registry import args_from_dict, spec_of

log = logging.getLogger("titan_npu")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
EXPORT_MARKER = outputs.marker_name("export")  # in a Hugging Face export: its files (what --overwrite may replace)
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


def checkpoint_model_args(path: Path, info: dict | None = None) -> Any:
    """The model shapes a checkpoint was trained with (from its checkpoint.json, or `info` already read from it)."""
    model_args = (storage.read_info(path) if info is None else info).get("model_args")
    if not model_args:
        raise CheckpointError(f"{path}/{storage.INFO_FILE} records no model shapes; cannot write a Hugging Face "
                              "config for it (export --format pt works)")
    return args_from_dict(model_args)


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
    check_output(source, output, fmt, overwrite)
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
    marker = {"checkpoint": str(source.resolve()), "step": info["step"]}
    return _export_hf(source, metadata, model, output, dtype, args, max_shard_bytes, extra, marker)


def _relation(output: Path, other: Path) -> str | None:
    """'is' / 'contains' / 'lies inside' when the two paths overlap on disk, else None."""
    out, src = output.resolve(), other.resolve()
    if out == src:
        return "is"
    if out in src.parents:
        return "contains"
    if src in out.parents:
        return "lies inside"
    return None


def refuse_overlap(flag: str, output: Path, what: str, source: Path) -> None:
    """CheckpointError when `output` is, contains or lies inside `source` (writing it would destroy the input)."""
    relation = _relation(output, source)
    if relation is not None:
        fix = "choose another path" if relation == "is" else "write to a path outside it"
        raise CheckpointError(f"{flag} {output} {relation} the {what} {source}; {fix}")


def check_output(source: Path, output: Path, fmt: str, overwrite: bool) -> None:
    """Refuse an --output whose writing would destroy something (outputs.py's rule): the checkpoint itself (or a
    folder holding it), any checkpoint's or prepared dataset's files, or with --overwrite what is not an earlier
    export."""
    refuse_overlap("--output", output, "checkpoint", source)
    if fmt == "pt":
        outputs.check_file_output("--output", output, overwrite, CheckpointError, "export",
                                  f"is a folder; --format pt writes one file: name a file such as "
                                  f"{output / 'model.pt'}")
    else:
        outputs.check_folder_output("--output", output, "export", overwrite, CheckpointError, "export",
                                    allow="export")


def current_umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _load_group(source: Path, metadata, keys: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = load_tensors(source, metadata, [f"model.{k}" for k in keys])
    return {k: tensors[f"model.{k}"].to(dtype) for k in keys}


def _export_pt(source: Path, metadata, keys: list[str], output: Path, dtype: torch.dtype) -> Path:
    state: dict[str, torch.Tensor] = {}
    for group in _groups(keys):
        state.update(_load_group(source, metadata, group, dtype))
    with atomic_path(output) as tmp:
        torch.save(state, tmp)
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


def _export_hf(source: Path, metadata, model: dict, output: Path, dtype: torch.dtype, args: Any,
               max_shard_bytes: int, tokenizer: list[Path], marker: dict) -> list[Path]:
    from safetensors.torch import save_file

    adapter = spec_of(args).hf
    if adapter is None:
        raise CheckpointError(f"{args.family} has no Hugging Face format; export it with --format pt")
    sizes = {k: _nbytes(tuple(meta.size), dtype) for k, meta in model.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    # An existing output is an earlier export holding only its own files (check_output): it keeps its name until the
    # new one is complete.
    with atomic_dir(output) as tmp:
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        weight_map: dict[str, str] = {}
        for name, keys in zip(names, shards):
            hf = adapter.to_hf(_load_group(source, metadata, keys, dtype), args)
            save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in hf})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = {**adapter.config(args), "torch_dtype": HF_DTYPE_NAMES[dtype]}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in tokenizer:
            shutil.copyfile(f, tmp / _hf_tokenizer_name(f))
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:  # safetensors and mkstemp-style writers make 0600: the team must be able to read them
            os.chmod(tmp / name, 0o666 & ~current_umask())
        outputs.write_marker(tmp, "export", files, **marker)
    return [output / name for name in files]

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_npu import outputs
from titan_npu.atomic import atomic_dir, atomic_path
from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries
from titan_npu.data.tokenizer import BYTE_TOKENIZER_NAMES
from titan_npu.errors import CheckpointError
from titan_npu.lora.names import ADAPTER_NAMES, adapter_module, is_adapter_name
from titan_npu.lora.peft import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_config,
    merged,
    peft_tensors,
    refuse_moe_mlp_adapters,
)
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
    merge: bool = False,
) -> list[Path]:
    """Write a checkpoint's model weights as `fmt` (pt | hf | peft) in `dtype` to `output`; returns the files written.

    For hf, the tokenizer's files (`tokenizer`, or by default the data.tokenizer the checkpoint records) are
    copied beside the weights. A LoRA checkpoint's adapters: peft writes them alone (docs/lora.md); merge folds
    them into the weights (W + scaling B A), as pt always does (its one state dict is the model the run trained,
    which generate, eval and import read); otherwise hf writes the frozen base.
    """
    source, output = Path(source), Path(output)
    if fmt not in ("pt", "hf", "peft"):
        raise CheckpointError(f"--format {fmt!r} is unknown; use pt (one full state dict file), hf (Hugging Face) "
                              "or peft (LoRA adapters)")
    if merge and fmt == "peft":
        raise CheckpointError("--merge with --format peft: peft's files hold the adapters alone; drop --merge, or "
                              "write merged weights with --format hf --merge")
    storage.check_checkpoint_dir(source)
    check_output(source, output, fmt, overwrite)
    metadata = read_metadata(source)
    model = tensor_entries(metadata, "model.")
    if not model:
        raise CheckpointError(f"{source} holds no model weights (no 'model.' entries); is it a titan-npu checkpoint?")
    info = storage.read_info(source)
    lora = _lora_of(source, info, model, fmt, merge)
    base = {k: v for k, v in model.items() if not is_adapter_name(k)}
    merged = merge or fmt == "pt"
    weights = Source(source, metadata, lora if merged else None)
    if fmt == "pt":
        output.parent.mkdir(parents=True, exist_ok=True)
        return [_export_pt(weights, list(model if lora is None else base), output, dtype)]
    args = checkpoint_model_args(source, info)
    output.parent.mkdir(parents=True, exist_ok=True)
    marker = {"checkpoint": str(source.resolve()), "step": info["step"]}
    if fmt == "peft":
        return _export_peft(weights, model, output, dtype, args, lora, marker)
    extra = tokenizer_files(info.get("tokenizer") if tokenizer is None else tokenizer)
    return _export_hf(weights, base, output, dtype, args, max_shard_bytes, extra, marker)


def _lora_of(source: Path, info: dict, model: dict, fmt: str, merge: bool) -> dict | None:
    """The checkpoint's [lora] record when it holds adapters (None otherwise), refusing --format peft and --merge
    without them."""
    has_adapters = any(is_adapter_name(k) for k in model)
    lora = info.get("lora") if has_adapters else None
    if has_adapters and not lora:
        raise CheckpointError(f"{source} holds adapters but its {storage.INFO_FILE} records no [lora] settings; "
                              "it was not written by a LoRA run of titan-npu")
    if (fmt == "peft" or merge) and lora is None:
        what = "--format peft" if fmt == "peft" else "--merge"
        raise CheckpointError(f"{what}: {source} holds no LoRA adapters (trained without [lora] enable = true); "
                              "export its weights with --format hf or pt")
    return lora


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


@dataclass(frozen=True)
class Source:
    """Where the model's tensors are read from; `merge_lora` (the checkpoint's [lora] record): each adapted weight
    is read as W + scaling B A."""

    source: Path
    metadata: Any
    merge_lora: dict | None = None


def _load_group(weights: Source, keys: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    wanted = list(keys)
    if weights.merge_lora is not None:
        entries = weights.metadata.state_dict_metadata
        adapted = [k for k in keys if k.endswith(".weight") and f"model.{adapter_module(k)}.lora_A" in entries]
        wanted += [f"{k.removesuffix('.weight')}.{n}" for k in adapted for n in ADAPTER_NAMES]
    tensors = {k.removeprefix("model."): v
               for k, v in load_tensors(weights.source, weights.metadata, [f"model.{k}" for k in wanted]).items()}
    out = {}
    for k in keys:
        module = k.removesuffix(".weight")
        if weights.merge_lora is not None and f"{module}.lora_A" in tensors and k.endswith(".weight"):
            out[k] = merged(tensors[k], tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"],
                            weights.merge_lora).to(dtype)
        else:
            out[k] = tensors[k].to(dtype)
    return out


def _export_pt(weights: Source, keys: list[str], output: Path, dtype: torch.dtype) -> Path:
    state: dict[str, torch.Tensor] = {}
    for group in _groups(keys):
        state.update(_load_group(weights, group, dtype))
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


def _export_hf(weights: Source, model: dict, output: Path, dtype: torch.dtype, args: Any,
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
            hf = adapter.to_hf(_load_group(weights, keys, dtype), args)
            save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in hf})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = {**adapter.config(args), "torch_dtype": HF_DTYPE_NAMES[dtype]}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in tokenizer:
            shutil.copyfile(f, tmp / _hf_tokenizer_name(f))
        files = _publishable(tmp, marker)
    return [output / name for name in files]


def _publishable(tmp: Path, marker: dict) -> list[str]:
    """The files of an export folder being written, readable by the team and listed in its marker."""
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:  # safetensors and mkstemp-style writers make 0600: the team must be able to read them
        os.chmod(tmp / name, 0o666 & ~current_umask())
    outputs.write_marker(tmp, "export", files, **marker)
    return files


def _export_peft(weights: Source, model: dict, output: Path, dtype: torch.dtype, args: Any, lora: dict,
                 marker: dict) -> list[Path]:
    """adapter_model.safetensors + adapter_config.json, as peft's save_pretrained writes them."""
    from safetensors.torch import save_file

    adapter = spec_of(args).hf
    if adapter is None:
        raise CheckpointError(f"{args.family} has no Hugging Face format; its adapters cannot be written for peft "
                              "(export --format pt keeps them)")
    modules = _ordered_keys(list({adapter_module(k) for k in model if is_adapter_name(k)}))
    tensors: dict[str, torch.Tensor] = {}
    for group in _groups(modules):
        loaded = _load_group(weights, [f"{m}.{n}" for m in group for n in ADAPTER_NAMES], torch.float32)
        for m in group:
            tensors.update(peft_tensors(adapter, args, m, loaded[f"{m}.lora_A"], loaded[f"{m}.lora_B"]))
    hf_modules = [k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                  for k in tensors if k.endswith(".lora_A.weight")]
    refuse_moe_mlp_adapters(hf_modules, spec_of(args).experts is not None)
    with atomic_dir(output) as tmp:
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(tmp / PEFT_WEIGHTS),
                  metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(adapter_config(lora, hf_modules), indent=2))
        files = _publishable(tmp, marker)
    return [output / name for name in files]

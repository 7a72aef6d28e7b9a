"""Each rank reads only the slices it holds of a Hugging Face safetensors directory (checkpoint.initial_load).

For every parameter of the rank's model parts (a plain tensor or a DTensor of any placement: FSDP, TP, FSDP x TP
strided, uneven, replicated), models/init.py's `local_indices` gives the global rows and columns the rank holds.
They are read as runs of consecutive indices with safetensors' `get_slice` (the file is memory-mapped: only those
bytes are read), brought into our layout by the family's `from_hf_layout` (q/k rows are permuted within each head,
so their runs are read rounded out to whole heads, permuted, then cut), cast to the parameter's dtype and copied
into the rank's local shard. A tensor that stacks HF tensors along dim 0 (MoE experts, the family's
`stacked_names`) reads, for each of its dim-0 indices the rank holds, that HF tensor's slice: a rank holding some
experts reads only those. No collective: a replicated parameter is read by every rank that holds it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_npu.checkpoint.formats import hf_files, hf_state_dict
from titan_npu.errors import CheckpointError
from titan_npu.lora.names import is_adapter_name
from titan_npu.models.init import canonical_name, local_indices

# A tied checkpoint (config.json's tie_word_embeddings) stores the output projection as the embedding.
TIED_OUTPUT = ("output.weight", "tok_embeddings.weight")


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a safetensors directory: the file that holds it and its shape."""

    file: Path
    shape: tuple[int, ...]


def safetensors_tensors(path: Path) -> dict[str, HFTensor] | None:
    """Hugging Face name -> file and shape of every tensor (headers only); None unless all weights are safetensors."""
    files = hf_files(path)
    if any(file.suffix != ".safetensors" for file in files):
        return None
    from safetensors import safe_open

    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = HFTensor(file, tuple(handle.get_slice(key).get_shape()))
        except Exception as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    return tensors


def meta_state_dict(tensors: dict[str, HFTensor], spec: Any, args: Any, tied: bool
                    ) -> tuple[dict[str, torch.Tensor], Any, str | None]:
    """Our names and shapes of the directory's tensors, as meta tensors (the family's from_hf, reading nothing),
    the args of the model they fill and the line on what config.json asks for that they lack (formats.py)."""
    meta = {key: torch.empty(t.shape, device="meta") for key, t in tensors.items()}
    return hf_state_dict(meta, spec, args, tied)


def read_block(handle: Any, key: str, index: tuple[slice, ...]) -> torch.Tensor:
    """The block `index` (a slice per dim) of tensor `key` of an open safetensors file, reading only its bytes."""
    return handle.get_slice(key)[index]


def _runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive global indices: (position in the shard, first global index, length)."""
    if len(indices) == 0:
        return []
    breaks = (torch.nonzero(indices[1:] - indices[:-1] != 1).flatten() + 1).tolist()
    return [(start, int(indices[start]), end - start) for start, end in zip([0, *breaks], [*breaks, len(indices)])]


def _windows(runs: list[tuple[int, int, int]], block: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """The ranges to read along one dim: the runs rounded out to whole blocks, overlapping ones merged, each with
    the runs it covers."""
    windows: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    for run in sorted(runs, key=lambda r: r[1]):
        lo, hi = run[1] // block * block, -(-(run[1] + run[2]) // block) * block
        if windows and lo <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(hi, windows[-1][1]), [*windows[-1][2], run])
        else:
            windows.append((lo, hi, [run]))
    return windows


@torch.no_grad()
def read_shard(handle: Any, key: str, local: torch.Tensor, indices: list[torch.Tensor], block: int,
               layout: Any) -> int:
    """Fill `local` (the piece at per-dim global `indices`) from tensor `key`; `layout` brings a block read
    (whole `block`s of rows) into our layout. Returns the bytes read."""
    per_dim = [_windows(_runs(ix), block if dim == 0 else 1) for dim, ix in enumerate(indices)]
    read = 0
    for window in itertools.product(*per_dim):
        values = layout(read_block(handle, key, tuple(slice(lo, hi) for lo, hi, _ in window)))
        read += values.numel() * values.element_size()
        for runs in itertools.product(*[covered for _, _, covered in window]):
            into = tuple(slice(at, at + n) for at, _, n in runs)
            take = tuple(slice(first - lo, first - lo + n) for (_, first, n), (lo, _, _) in zip(runs, window))
            local[into].copy_(values[take])
    return read


def load_hf_slices(parts: list[nn.Module], tensors: dict[str, HFTensor], spec: Any, args: Any,
                   tied: bool) -> int:
    """Fill every parameter of `parts` with this rank's slices of the directory's `tensors` (names and shapes
    already checked against the model); returns the bytes this rank read."""
    from safetensors import safe_open

    # A parameter under several names (tied embeddings) takes the last one's values, as load_state_dict would.
    params: dict[int, tuple[str, torch.Tensor]] = {}
    for part in parts:
        for raw_name, param in part.named_parameters(remove_duplicate=False):
            if not is_adapter_name(raw_name):  # LoRA's adapters keep their initial values
                params[id(param)] = (canonical_name(raw_name), param)
        # Persistent buffers are weights too (a router's score bias: Hugging Face's e_score_correction_bias).
        saved = part.state_dict().keys()
        for raw_name, buffer in part.named_buffers():
            if raw_name in saved:
                params[id(buffer)] = (canonical_name(raw_name), buffer)
    by_file: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    read = 0
    for name, param in params.values():
        source = TIED_OUTPUT[1] if tied and name == TIED_OUTPUT[0] else name
        stacked = spec.hf.stacked_names(source, args)
        if stacked is not None:
            read += _load_stacked(param, name, stacked, tensors)
            continue
        key = spec.hf.hf_name(source)
        by_file.setdefault(tensors[key].file, []).append((name, key, param))
    for file, entries in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as handle:
            for name, key, param in entries:
                local = param.to_local() if hasattr(param, "to_local") else param
                indices = local_indices(param)
                if tuple(len(ix) for ix in indices) != tuple(local.shape):
                    raise CheckpointError(f"{name}: the placements {getattr(param, 'placements', ())} give a "
                                          f"{tuple(len(ix) for ix in indices)} shard but the rank holds "
                                          f"{tuple(local.shape)}; this layout cannot be read shard-wise")
                read += read_shard(handle, key, local, indices, spec.hf.permuted_block(name, args),
                                   lambda values, name=name: spec.hf.from_hf_layout(name, values, args))
    return read


@torch.no_grad()
def _load_stacked(param: torch.Tensor, name: str, keys: list[str], tensors: dict[str, HFTensor]) -> int:
    """Fill the rank's piece of a tensor stacking HF tensors `keys` along dim 0 (experts): for each dim-0 index it
    holds, the slice of that HF tensor it holds. Returns the bytes read."""
    from safetensors import safe_open

    local = param.to_local() if hasattr(param, "to_local") else param
    indices = local_indices(param)
    if tuple(len(ix) for ix in indices) != tuple(local.shape):
        raise CheckpointError(f"{name}: the placements {getattr(param, 'placements', ())} give a "
                              f"{tuple(len(ix) for ix in indices)} shard but the rank holds {tuple(local.shape)}; "
                              f"this layout cannot be read shard-wise")
    read = 0
    for row, index in enumerate(indices[0].tolist()):
        key = keys[index]
        with safe_open(str(tensors[key].file), framework="pt") as handle:
            read += read_shard(handle, key, local[row], indices[1:], 1, lambda values: values)
    return read


def read_volume_line(per_rank: list[int], full: int, path: Path) -> str:
    """The summary rank 0 logs: bytes read per rank (min / max / total) against the directory's full size."""
    return (f"initial_load: read {path} shard-wise: {_size(min(per_rank))} to {_size(max(per_rank))} per rank "
            f"({_size(sum(per_rank))} over {len(per_rank)} ranks); the full weights are {_size(full)}, "
            f"{_size(len(per_rank) * full)} if every rank read them")


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number of at least 1 ('1.5 GiB')."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

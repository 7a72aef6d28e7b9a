"""Layout-independent initialisation: the same seed gives the same weights in every parallel layout.

The scheme (shared by every model family; a family only declares each parameter's distribution):

- Every parameter is named by its fully-qualified name in the unsplit model (`layers.7.attention.wq.weight`;
  pipeline stages keep global layer ids, wrapper prefixes such as `_checkpoint_wrapped_module` are dropped) and
  has a `ParamInit` (normal, truncated normal or a constant) from the family's `param_inits()` table.
- Its global tensor is cut into fixed tiles: `TILE_ROWS x TILE_COLS` over the last two dims and one slice deep
  along any leading dim (so an expert weight [n_experts, out, in] has tiles one expert deep), `TILE_1D` elements
  for a vector. Tile k is drawn whole from a generator seeded with hash(seed, name, k). The tiles are part of the
  scheme: changing their size or the hash changes every initial weight.
- A rank holding any piece of the parameter (a DTensor's local shard: FSDP's dim-0 chunk, a tensor-parallel
  column or row slice, an uneven last chunk, FSDP x TP's strided chunk, HSDP's replica of a chunk, a plain
  replica) finds the global indices of its piece from the DTensor's placements, draws only the tiles overlapping
  them and copies the overlap in. The values therefore depend on (seed, model config) alone, and a rank draws
  about its own shard: a sharded large parameter is never materialised whole on one rank.

Tiles are drawn on the CPU generator (Mersenne Twister), not the device's: it is the one generator every device
type shares, so a debug run on the CPU and the same run on an NPU or GPU start from the same weights, and device
generators (Philox on CUDA, the NPU's own) give other streams per device type and offset. The cost is host work
(tiles are drawn by several threads: the host's cores shared among its ranks) and a host-to-device copy of the
rank's own shard; a 70B model on 64 ranks draws about 1.1B numbers per rank.
Ranks on hosts with the same CPU kind draw bit-identical tiles; a different CPU kind (x86 vs. Arm) may round the
normal's transcendental functions differently in the last bit.

Layouts still to come fit as they are: expert parallelism shards an expert weight on dim 0 (Shard(0) over the
ep mesh), whose tiles are one expert deep, so a rank draws only its experts; context parallelism splits the
sequence, not the parameters (a cp mesh dimension appears in a parameter's placements as Replicate or folded into
FSDP's Shard). A placement other than Shard / Replicate (e.g. Partial) is refused rather than drawn differently.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

TILE_ROWS = 128
TILE_COLS = 512
TILE_1D = TILE_ROWS * TILE_COLS
MAX_DRAW_WORKERS = 32
# Module wrappers that insert a component into parameter names without changing the model.
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


@dataclass(frozen=True)
class ParamInit:
    """How one parameter's values are drawn: `normal`, `trunc_normal` (cut at absolute low/high) or `constant`."""

    kind: str
    std: float = 1.0
    mean: float = 0.0
    low: float = -2.0
    high: float = 2.0
    value: float = 0.0

    def draw(self, out: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `out` (a CPU tensor) from `generator`."""
        if self.kind == "normal":
            out.normal_(self.mean, self.std, generator=generator)
        elif self.kind == "trunc_normal":
            nn.init.trunc_normal_(out, self.mean, self.std, self.low, self.high, generator=generator)
        else:
            raise ValueError(f"ParamInit kind {self.kind!r} draws nothing; use normal, trunc_normal or constant")


def normal(std: float, mean: float = 0.0) -> ParamInit:
    """N(mean, std^2)."""
    return ParamInit("normal", std=std, mean=mean)


def trunc_normal(std: float, low: float = -2.0, high: float = 2.0, mean: float = 0.0) -> ParamInit:
    """N(mean, std^2) redrawn outside [low, high] (absolute bounds, as nn.init.trunc_normal_)."""
    return ParamInit("trunc_normal", std=std, mean=mean, low=low, high=high)


def constant(value: float) -> ParamInit:
    """Every element `value` (norm scales: 1)."""
    return ParamInit("constant", value=value)


def prefixed(prefix: str, inits: Mapping[str, ParamInit]) -> dict[str, ParamInit]:
    """A submodule's table under its name in the parent: {"wq.weight": ...} -> {"attention.wq.weight": ...}."""
    return {f"{prefix}.{name}": init for name, init in inits.items()}


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model (activation-checkpoint / compile / FSDP1 wrappers removed)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def tile_steps(shape: Sequence[int]) -> tuple[int, ...]:
    """The tile edge along each dim of a global tensor of `shape`."""
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (TILE_1D,)
    return (1,) * (len(shape) - 2) + (TILE_ROWS, TILE_COLS)


def tile_seed(seed: int, name: str, tile: Sequence[int]) -> int:
    """The generator seed of one tile: a hash of (seed, parameter name, tile coordinates), stable across runs."""
    key = f"{seed}|{name}|{','.join(map(str, tile))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def draw_tile(init: ParamInit, seed: int, name: str, tile: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """Tile `tile` (of `shape`) of parameter `name`, in fp32 on the CPU."""
    values = torch.empty(tuple(shape), dtype=torch.float32)
    init.draw(values, torch.Generator().manual_seed(tile_seed(seed, name, tile)))
    return values


# ---------------------------------------------------------------- which global indices a rank holds


def _chunk(indices: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """Chunk i of n as torch.chunk (and DTensor's Shard) cut: ceil(len / n) each, the last ones short or empty."""
    size = -(-len(indices) // n)
    return indices[i * size:(i + 1) * size]


def placement_indices(
    shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> list[torch.Tensor]:
    """Per dim, the global indices (in local order) of the shard at mesh `coordinate` of a DTensor of `shape`.

    Placements apply left to right over the mesh dims, as DTensor reads them: Shard(d) takes its chunk of what
    the earlier ones left along d; _StridedShard(d, split_factor=f) (FSDP over a tensor-parallel dim) cuts that
    into f pieces, takes its chunk of each and joins them; Replicate keeps everything.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    indices = [torch.arange(size) for size in shape]
    for placement, n, i in zip(placements, mesh_shape, coordinate):
        if isinstance(placement, _StridedShard):
            d = placement.dim % len(shape)
            pieces = [_chunk(indices[d], placement.split_factor, j) for j in range(placement.split_factor)]
            indices[d] = torch.cat([_chunk(piece, n, i) for piece in pieces])
        elif isinstance(placement, Shard):
            d = placement.dim % len(shape)
            indices[d] = _chunk(indices[d], n, i)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"parameter placement {placement} cannot be initialised shard-wise; parameters are "
                             "Shard or Replicate DTensors")
    return indices


def local_indices(param: torch.Tensor) -> list[torch.Tensor]:
    """Per dim, the global indices of the elements this rank holds of `param` (all of them for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return [torch.arange(size) for size in param.shape]
    mesh = param.device_mesh
    return placement_indices(param.shape, param.placements, mesh.shape, mesh.get_coordinate())


# ---------------------------------------------------------------- which tiles cover a shard


def _segments(indices: torch.Tensor, step: int) -> dict[int, list[tuple[slice, slice]]]:
    """Along one dim: tile number -> [(positions in the shard, positions in the tile)] covering `indices`."""
    out: dict[int, list[tuple[slice, slice]]] = {}
    if len(indices) == 0:
        return out
    # Runs of consecutive global indices (one run for every placement but a strided one).
    breaks = (torch.nonzero(indices[1:] - indices[:-1] != 1).flatten() + 1).tolist()
    for start, end in zip([0, *breaks], [*breaks, len(indices)]):
        g, g_end = int(indices[start]), int(indices[end - 1]) + 1
        local = start
        while g < g_end:
            tile = g // step
            stop = min(g_end, (tile + 1) * step)
            inside = slice(g - tile * step, stop - tile * step)
            out.setdefault(tile, []).append((slice(local, local + stop - g), inside))
            local += stop - g
            g = stop
    return out


def tile_plan(
    shape: Sequence[int], indices: Sequence[torch.Tensor]
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], list[tuple[tuple[slice, ...], tuple[slice, ...]]]]]:
    """The tiles that overlap the shard given by per-dim `indices` of a global tensor of `shape`.

    Yields (tile coordinates, tile shape, [(slices into the shard, slices into the tile)]), one per tile drawn.
    """
    steps = tile_steps(shape)
    per_dim = [_segments(ix, step) for ix, step in zip(indices, steps)]
    for tile in itertools.product(*[sorted(segments) for segments in per_dim]):
        tile_shape = tuple(min(step, size - k * step) for k, step, size in zip(tile, steps, shape))
        blocks = [(tuple(b[0] for b in combo), tuple(b[1] for b in combo))
                  for combo in itertools.product(*[segments[k] for segments, k in zip(per_dim, tile)])]
        yield tile, tile_shape, blocks


# ---------------------------------------------------------------- filling parameters


def draw_workers() -> int:
    """Threads that draw tiles at once: this host's cores shared among its ranks (torchrun's LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DRAW_WORKERS, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@torch.no_grad()
def fill_shard(local: torch.Tensor, shape: Sequence[int], indices: Sequence[torch.Tensor], name: str,
               init: ParamInit, seed: int) -> None:
    """Fill `local`, the piece at per-dim global `indices` of parameter `name` (global `shape`), tile by tile.

    Tiles are independent (each has its own generator), so worker threads draw them, several at once; a few tiles
    per thread are in flight, never the whole shard. (Even one worker thread: a tile's ops are too small for
    torch's intra-op threads, whose start-up in the calling thread costs more than the tile on a busy host.)
    """
    plan = list(tile_plan(shape, indices))
    workers = max(1, min(draw_workers(), len(plan)))

    def draw(entry: tuple) -> torch.Tensor:
        return draw_tile(init, seed, name, entry[0], entry[1])

    with ThreadPoolExecutor(workers) as pool:
        step = 4 * workers
        for start in range(0, len(plan), step):
            batch = plan[start:start + step]
            for (_, _, blocks), values in zip(batch, pool.map(draw, batch)):
                for shard_slices, tile_slices in blocks:
                    local[shard_slices].copy_(values[tile_slices])


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, init: ParamInit, seed: int) -> None:
    """Fill this rank's piece of parameter `name` (plain tensor or DTensor) with its layout-independent values."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.is_meta:
        return
    if init.kind == "constant":
        local.fill_(init.value)
        return
    indices = local_indices(param)
    held = tuple(len(ix) for ix in indices)
    if held != tuple(local.shape):
        raise ValueError(f"{name}: the placements {getattr(param, 'placements', ())} give a {held} shard but the "
                         f"rank holds {tuple(local.shape)}; this layout's sharding is not one init knows")
    fill_shard(local, param.shape, indices, name, init, seed)


def attached_inits(module: nn.Module) -> dict[str, ParamInit]:
    """The distributions of parameters attached to a model from outside its family (adapters): every submodule
    with `attached_param_inits()` lists its own, here under their canonical names in `module`."""
    inits: dict[str, ParamInit] = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "attached_param_inits"):
            inits.update(prefixed(canonical_name(name), sub.attached_param_inits()))
    return inits


def init_parameters(module: nn.Module, inits: Mapping[str, ParamInit], seed: int) -> None:
    """Initialise every parameter of `module` (a model, a pipeline stage, parallelised or not) from `inits`.

    `inits` maps each parameter's name in the unsplit model to its distribution; a parameter without an entry is
    an error, so a new parameter cannot silently keep uninitialised memory.
    """
    for raw_name, param in module.named_parameters():
        name = canonical_name(raw_name)
        if name not in inits:
            raise ValueError(f"parameter {name} has no initialisation; add it to "
                             f"{type(module).__name__}.param_inits()")
        init_parameter(param, name, inits[name], seed)

"""The integer arithmetic of a parallel layout, free of torch: mesh coordinates, FSDP's dim-0 chunks, pipeline
stages and microbatches.

The trainer (dims.py, layout.py, pipeline.py) and the memory planner (titan_npu/planner/) both call these, so the
planner's shards, stages and batch split are the trainer's by construction.
"""

from __future__ import annotations

from collections.abc import Mapping

# Mesh dimension order, outermost first: pipeline stages talk least often, tensor-parallel ranks most, so tp is
# innermost (adjacent ranks, on one node) and pp outermost (may cross nodes).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# With context parallelism the cp ranks sit between dp_shard and tp (parallel/dims.py builds that mesh).
CP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def mesh_dims(degrees: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh's dimension names, outermost first: CP_MESH_DIMS when `degrees` has a cp entry, else MESH_DIMS."""
    return CP_MESH_DIMS if "cp" in degrees else MESH_DIMS


def mesh_coordinates(degrees: Mapping[str, int], rank: int) -> dict[str, int]:
    """A rank's index along each mesh dimension (mesh_dims order), as init_device_mesh lays ranks out (row-major)."""
    names = mesh_dims(degrees)
    coords, rest = {}, rank
    for name in reversed(names):
        coords[name] = rest % degrees[name]
        rest //= degrees[name]
    return {name: coords[name] for name in names}


def mesh_rank(degrees: Mapping[str, int], coords: Mapping[str, int]) -> int:
    """The rank at the given mesh coordinates (missing ones 0): the inverse of mesh_coordinates."""
    rank = 0
    for name in mesh_dims(degrees):
        rank = rank * degrees[name] + coords.get(name, 0)
    return rank


def chunk_size(n: int, parts: int, index: int) -> int:
    """Length of torch.chunk(n, parts)[index] (0 past the last chunk): how DTensor's Shard and FSDP2 cut a dim."""
    step = -(-n // parts)
    return max(0, min(step, n - index * step))


# Schedules that run two stages per rank placed in a V: rank r holds stage r and stage 2 pp - 1 - r, so the first
# and last stages share rank 0 and the middle two (pp - 1, pp) rank pp - 1, which hands activations between them
# without a send.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split a stage's backward into an input step (I) and a later weight step (W). torch's W step takes the
# gradients of the parameters the stage's module holds when it runs, so FSDP must keep the forward's gathered
# parameters registered until then (no reshard after forward): see reshards_after_forward.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", *V_SCHEDULES)
# Schedules with several looped stages per rank (rank r: r, r + pp, ...); 2 unless pp_virtual_stages says more.
LOOPED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


def stages_per_rank(pp_schedule: str, pp_virtual_stages: int) -> int:
    """Pipeline stages each pp rank runs: pp_virtual_stages, or 2 for the looped and V schedules and 1 otherwise."""
    if pp_virtual_stages > 0:
        return pp_virtual_stages
    return 2 if pp_schedule in LOOPED_SCHEDULES + V_SCHEDULES else 1


def reshards_after_forward(setting: bool, pp_degree: int, pp_schedule: str) -> bool:
    """Whether FSDP frees the gathered parameters after forward: parallel.reshard_after_forward, except under a
    schedule with a split weight backward (SPLIT_BACKWARD_SCHEDULES), whose W step needs them gathered."""
    return setting and not (pp_degree > 1 and pp_schedule in SPLIT_BACKWARD_SCHEDULES)


def leftover_stages(n_stages: int, pp_schedule: str = "1F1B") -> list[int]:
    """The stages that take the layers an even split leaves over, in the order they take them. The first stage also
    holds the embedding and the last the output projection and loss, so the middle stages come first; under a V
    schedule rank 0 holds both (stage 0 and stage 2 pp - 1), so each other rank takes one on its first stage, then
    one on its second, before rank 0's stages take any."""
    if pp_schedule in V_SCHEDULES and n_stages >= 2:
        pp = n_stages // 2
        return list(range(1, pp)) + list(range(2 * pp - 2, pp - 1, -1)) + [0, n_stages - 1]
    return list(range(1, n_stages - 1)) + [0, n_stages - 1]


def v_min_microbatches(pp_schedule: str, pp_degree: int) -> int:
    """Fewest microbatches a V schedule runs at pp_degree: DualPipeV one per stage (2 pp, torch requires it),
    ZBVZeroBubble 2 pp - 1 (what torch's schedule needs to fill the V; it pads fewer with idle slots); pp_degree for
    the others."""
    if pp_schedule == "DualPipeV":
        return 2 * pp_degree
    return 2 * pp_degree - 1 if pp_schedule == "ZBVZeroBubble" else pp_degree


def microbatches(pp_microbatches: int, pp_degree: int) -> int:
    """Microbatches per pipeline step: pp_microbatches, 0 = pp_degree * 2."""
    return pp_microbatches or pp_degree * 2


def expert_coordinates(dp_shard_index: int, ep_degree: int) -> tuple[int, int]:
    """(efsdp index, ep index) of a dp_shard rank: ep consecutive dp_shard ranks form an expert-parallel group, and
    the dp_shard / ep ranks at the same place in their groups hold the same experts (parallel/dims.py's mesh)."""
    return dp_shard_index // ep_degree, dp_shard_index % ep_degree


def local_batch(batch_size: int, gradient_accumulation_steps: int) -> int:
    """Sequences one data-parallel rank runs per optimizer step (under PP, one pipeline step's microbatches)."""
    return batch_size * gradient_accumulation_steps


def stage_ids_for_rank(pp_rank: int, pp_degree: int, stages_per_rank: int, pp_schedule: str = "1F1B") -> list[int]:
    """The stage indices pp rank `pp_rank` runs: V-shaped (pp_rank, 2 pp - 1 - pp_rank) for the V schedules, else
    looped (pp_rank, pp_rank + pp, ...), as torch.distributed.pipelining's schedules expect."""
    if pp_schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + i * pp_degree for i in range(stages_per_rank)]

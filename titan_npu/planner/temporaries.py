"""Temporary buffers of a rank: unsharded FSDP parameters and gradients, autocast's weight copies, the optimizer
step's intermediates, and the backward peak the activation walk found."""

from __future__ import annotations

from dataclasses import dataclass

from titan_npu.parallel.float8 import wants_float8_all_gather
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.parameters import (
    float8_kinds,
    is_expert_kind,
    layers_kinds,
    numel,
    optimizer_state_multiplier,
    parameter_kinds,
    tensor_parallel_dims,
)
from titan_npu.planner.stages import rank_parts
from titan_npu.trainer.state_dtype import CHUNK_ELEMENTS


@dataclass(frozen=True)
class TemporaryBytes:
    """Buffers that live only during forward/backward (or the optimizer step)."""

    backward: int  # loss buffers or a block's recomputation (ActivationPeak.extra)
    fsdp: int  # unsharded parameters and gradients of the blocks being computed
    autocast: int  # low-precision weight copies autocast keeps for backward (no FSDP mixed precision)
    optimizer_step: int  # foreach optimizer intermediates (after backward, when activations are gone)

    @property
    def during_backward(self) -> int:
        return self.backward + self.fsdp + self.autocast


def unsharded_numel(kind: str, shape: tuple[int, ...], tp_dim: int | None, layout: Layout) -> int:
    """Elements of a block parameter FSDP unshards on a rank: its tensor-parallel slice (all of it when replicated
    over tp, tp_dim None), or for stacked experts the ep rank's experts (none when no other rank holds the same
    experts: FSDP leaves those, already whole)."""
    whole = numel(shape) // (layout.tp if tp_dim is not None else 1)
    if not is_expert_kind(kind):
        return whole
    if layout.ep > 1 and layout.expert_shards == 1:
        return 0
    return whole // layout.ep


@dataclass(frozen=True)
class RankBlocks:
    """What FSDP and autocast hold of a pipeline rank's parameters, in elements (bytes where named)."""

    n_blocks: int
    unsharded: int  # every block's unsharded_numel summed
    block: int  # the largest block's
    gathered_bytes: int  # the largest block as FSDP all-gathers it (compute dtype, float8 weights at 1 byte)
    root: int  # the embedding, norm and output the rank holds, over tp
    matrices: int  # the blocks' 2-D weights, over tp (what autocast copies)
    output: int  # the last stage's output matrix (tied: the embedding's) over tp; 0 on the other ranks


def rank_blocks(job: Job, layout: Layout, pp_rank: int) -> RankBlocks:
    """The blocks and root parameters of a pipeline rank, once per job, pp rank and layout.sharding (all they
    follow from)."""
    return job.memo(("rank_blocks", layout.sharding, pp_rank), lambda: _rank_blocks(job, layout, pp_rank))


def _rank_blocks(job: Job, layout: Layout, pp_rank: int) -> RankBlocks:
    """rank_blocks, computed."""
    kinds = parameter_kinds(job.args)
    tp_dims = tensor_parallel_dims(job.args)
    tp, c = layout.tp, job.compute_bytes
    parts = rank_parts(job.args, layout, pp_rank)
    layers = [i for p in parts for i in p.layers]
    # The rank's largest block (a MoE one where some are dense) sizes what FSDP holds unsharded at once.
    per_layer = layers_kinds(job.args, layers)
    # Blocks of the same kinds unshard the same elements: sized once each.
    block_sizes = {ks: sum(unsharded_numel(k, kinds[k], tp_dims[k], layout) for k in ks)
                   for ks in dict.fromkeys(map(tuple, per_layer.values()))}
    sizes = [block_sizes[tuple(per_layer[i])] for i in layers]
    # What an unsharded block takes: its float8 linears' weights at 1 byte under FSDP2's float8 all-gather.
    float8 = float8_kinds(job) if job.float8 is not None and wants_float8_all_gather(job.float8) else set()
    gathered = max((sum(unsharded_numel(k, kinds[k], tp_dims[k], layout) * (1 if k in float8 else c) for k in ks)
                    for ks in dict.fromkeys(map(tuple, per_layer.values()))), default=0)
    root = sum(numel(kinds[k]) for p in parts for k in p.root_kinds(kinds)) // tp
    matrices = sum(numel(kinds[k]) for i in layers for k in per_layer[i] if len(kinds[k]) == 2) // tp
    last = any(p.last for p in parts)
    output = numel(kinds.get("output.weight", kinds["tok_embeddings.weight"])) // tp if last else 0
    return RankBlocks(len(layers), sum(sizes), max(sizes, default=0), gathered, root, matrices, output)


def temporary_bytes(job: Job, layout: Layout, pp_rank: int, backward_extra: int, device_type: str = "cpu",
                    local_param_bytes: int = 0) -> TemporaryBytes:
    """Temporary buffers of a pipeline rank; local_param_bytes sizes the optimizer step's intermediates."""
    c = job.compute_bytes
    r = rank_blocks(job, layout, pp_rank)
    n_blocks, block, gathered, root = r.n_blocks, r.block, r.gathered_bytes, r.root
    fsdp = autocast = 0
    if layout.dp_enabled and layout.pp > 1:
        # Under pipelining the schedule skips FSDP's resharding and gradient reduction until the last micro-batch:
        # every block of the rank stays unsharded (compute dtype) and accumulates an unsharded fp32 gradient.
        fsdp = (r.unsharded + root) * (c + 4)
    elif layout.dp_enabled:
        # Unsharded copies in the compute dtype: the block being computed and the one prefetched (the last block
        # is never resharded after forward), and the root (embedding, norm, output); in backward, the block's
        # unsharded gradient and its fp32 copy for the reduce-scatter.
        grad_copy = 4 if c < 4 else 0
        fsdp = min(n_blocks, 2) * gathered + (block * (c + grad_copy) if n_blocks else 0) + root * c
        if not layout.reshards_after_forward:
            fsdp += max(0, n_blocks - 2) * gathered
    elif c < 4:
        # autocast caches one low-precision copy of every matmul weight for backward (not the embedding table).
        autocast = r.matrices * c
        if not layout.loss_chunk:  # the chunked loss rounds the output's matrix itself, briefly
            autocast += r.output * c
    # foreach AdamW (the NPU default) materialises sqrt(exp_avg_sq) for every parameter at once; fused kernels
    # (cuda, cpu) need no such buffer.
    optimizer_step = local_param_bytes if device_type == "npu" and optimizer_state_multiplier(job) == 2 else 0
    if job.state_dtype != "fp32" and job.optimizer.lower() != "sgd":
        # bf16 moments are updated through fp32 copies of both, a chunk of parameters at a time.
        chunk = 4 * min(CHUNK_ELEMENTS, local_param_bytes // 4)
        optimizer_step = min(optimizer_step, chunk) + 2 * chunk
    return TemporaryBytes(backward_extra, fsdp, autocast, optimizer_step)

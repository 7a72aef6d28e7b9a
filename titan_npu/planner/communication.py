"""Device memory outside the model's tensors (the collective library's buffers per communicator, the runtime's own
reserve) and the bytes a rank's expert- and context-parallel exchanges send per step."""

from __future__ import annotations

from titan_npu.models.registry import spec_of
from titan_npu.planner.layout import GiB, Job, Layout, MiB

# Device memory the runtime keeps for itself before the allocator sees any (CANN runtime and HCCL workspace on a
# 910B; CUDA context and cuBLAS workspace on a GPU). Assumptions, stated in docs/planning.md.
RUNTIME_RESERVE_BYTES = {"npu": 3 * GiB, "cuda": 1 * GiB, "cpu": 0}
HCCL_BUFFSIZE_DEFAULT_MB = 200  # HCCL's default; each communicator keeps an input and an output buffer of this size
NCCL_COMMUNICATOR_BYTES = 128 * MiB  # NCCL channels' staging buffers per communicator, order of magnitude


def communicators(layout: Layout) -> int:
    """Process groups a rank talks over: each mesh dim larger than 1, the flattened dp group(s), the experts' mesh
    and the world group."""
    if layout.world_size == 1:
        return 0
    n = sum(1 for size in layout.mesh_shape().values() if size > 1) + 1
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        n += 1
    if layout.cp > 1:
        n += 2  # dp_shard x cp (FSDP's group) and dp x cp (the token reductions), flattened
    if layout.cp_ulysses > 1:
        n += 2  # hybrid's Ulysses and ring groups
    if 1 < layout.ep < layout.dp_shard:
        n += 2  # the experts' own mesh: ep and efsdp groups
    return n


def communication_bytes(layout: Layout, device_type: str, hccl_buffsize_mb: int = 0) -> int:
    """Device memory the collective library keeps per rank (HCCL: 2 x HCCL_BUFFSIZE per communicator)."""
    groups = communicators(layout)
    if device_type == "npu":
        return groups * 2 * (hccl_buffsize_mb or HCCL_BUFFSIZE_DEFAULT_MB) * MiB
    if device_type == "cuda":
        return groups * NCCL_COMMUNICATOR_BYTES
    return 0


def expert_all_to_all_bytes(job: Job, layout: Layout, tokens: int, layers: int) -> float:
    """Bytes expert parallelism's all-to-alls send from a rank for `tokens` tokens through `layers` MoE layers.

    Under balanced routing each token's routed copies (the spec's ExpertTerms: routed_copies per MoE layer,
    all_to_all_width values each) go to the experts' ranks and come back, in forward and again (their gradients)
    in backward, once more in a recomputed forward; (ep - 1) / ep of them leave the rank."""
    if layout.ep == 1 or not layers:
        return 0.0
    a = job.args
    experts = spec_of(a).experts
    exchanges = 4 + (2 if layout.ac == "full" else 0)
    return (exchanges * layers * tokens * experts.routed_copies(a) * experts.all_to_all_width(a) * job.compute_bytes
            * (layout.ep - 1) / layout.ep)


def context_exchange_bytes(job: Job, layout: Layout, tokens: int, layers: int) -> float:
    """Bytes context parallelism sends from a rank for `tokens` local tokens through `layers` blocks (both parts of
    hybrid's: context_exchange_parts)."""
    return sum(context_exchange_parts(job, layout, tokens, layers))


def context_exchange_parts(job: Job, layout: Layout, tokens: int, layers: int) -> tuple[float, float]:
    """(Ulysses all-to-all bytes, ring bytes) a rank sends for `tokens` local tokens through `layers` blocks.

    Ring: the rank's K/V block travels cp - 1 hops in forward; backward sends K/V and their gradients around again
    (3 x in all). Ulysses: all-to-alls of q, k, v and the output in forward and of their gradients in backward,
    (cp - 1) / cp of each leaving the rank. Hybrid: Ulysses within the groups of u = cp_ulysses ranks ((u - 1) / u
    leaves), then the ring over the cp / u groups, each rank's block u x its tokens with 1 / u of the heads: as many
    K/V bytes as the plain ring's per hop."""
    if layout.cp == 1:
        return 0.0, 0.0
    a, c, cp = job.args, job.compute_bytes, layout.cp
    q, kv = a.q_dim // layout.tp, a.kv_dim // layout.tp
    u = {"ring": 1, "ulysses": cp}.get(layout.cp_mode, layout.cp_ulysses)
    ulysses = 2 * tokens * (2 * q + 2 * kv) * c * (u - 1) / u * layers
    ring = 3 * (cp // u - 1) * tokens * 2 * kv * c * layers
    return ulysses, ring

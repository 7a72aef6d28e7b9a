"""Device memory outside the model's tensors: the collective library's buffers per communicator and the
runtime's own reserve."""

from __future__ import annotations

from titan_npu.planner.layout import GiB, Layout, MiB

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
    n = sum(1 for size in layout.degrees().values() if size > 1) + 1
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        n += 1
    if layout.cp > 1:
        n += 2  # dp_shard x cp (FSDP's group) and dp x cp (the token reductions), flattened
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

"""Hardware specs and the analytic step-time model behind the planner's tokens/s ranking.

Compute time is the job's training FLOPs at an assumed fraction of the device's peak; communication time is
bytes over the effective bus bandwidth of the link a process group crosses (intra-node HCCS / NVLink, inter-node
RoCE / InfiniBand). FSDP traffic overlaps with compute, tensor-parallel traffic and the pipeline bubble do not.
See docs/planning.md for the formulas and their assumptions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from titan_npu.device.flops import lookup_peak_flops
from titan_npu.errors import ConfigError
from titan_npu.metrics.throughput import flops_per_token
from titan_npu.tools.memory_model import GiB, Job, Layout, local_numel, rank_parts

GB = 1e9
# Parameters per second one rank's host-side AdamW updates when the node's ranks share the host (cpu_offload).
HOST_ADAMW_PARAMS_PER_S = 0.5e9


@dataclass(frozen=True)
class Hardware:
    """One device kind and the links between devices (bandwidths: effective collective bus bandwidth per device)."""

    name: str
    device_type: str  # npu | cuda | cpu
    memory_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    intra_node_bw: float  # bytes/s
    inter_node_bw: float  # bytes/s
    intra_link: str
    inter_link: str
    host_bw: float = 25 * GB  # PCIe to host memory (cpu_offload traffic)


def _spec(name: str, device_type: str, memory_gib: float, intra_gbs: float, inter_gbs: float, intra: str,
          inter: str, flops_name: str | None = None) -> Hardware:
    peak = lookup_peak_flops(flops_name or name)
    assert peak is not None, name
    return Hardware(name, device_type, int(memory_gib * GiB), peak, intra_gbs * GB, inter_gbs * GB, intra, inter)


# Bandwidths are what a ring collective typically reaches per device (bus bandwidth), below the links' line rate:
# 910B HCCS ~160 GB/s in an 8-card Atlas 800T A2, 200GE RoCE per NPU ~20 GB/s; NVLink 3/4 ~230/360 GB/s;
# HDR/NDR InfiniBand per GPU ~22/45 GB/s. Measure yours with `titan-npu doctor` under torchrun and override.
DEVICES: dict[str, Hardware] = {
    spec.name.lower(): spec
    for spec in (
        _spec("910B1", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B2", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B2C", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B3", "npu", 64, 160, 20, "HCCS", "RoCE"),
        _spec("910B4", "npu", 32, 160, 20, "HCCS", "RoCE"),
        _spec("A100", "cuda", 80, 230, 22, "NVLink", "InfiniBand"),
        _spec("A800", "cuda", 80, 150, 22, "NVLink", "InfiniBand"),
        _spec("H100", "cuda", 80, 360, 45, "NVLink", "InfiniBand"),
        _spec("H800", "cuda", 80, 150, 45, "NVLink", "InfiniBand"),
        _spec("H200", "cuda", 141, 360, 45, "NVLink", "InfiniBand"),
        _spec("H20", "cuda", 96, 360, 45, "NVLink", "InfiniBand"),
    )
}


def parse_bytes(text: str) -> int:
    """'64GB' / '64G' / '64GiB' / '65536MB' -> bytes; GB means GiB here, as npu-smi and nvidia-smi count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ConfigError(f"--device-memory {text!r} is not a size; write it like 64GB, 80GiB or 32768MB")
    value, unit = float(match.group(1)), match.group(2)
    return int(value * 1024 ** "_kmgt".index(unit or "_"))


def hardware(name: str, memory: str | None = None, intra_node_gbs: float | None = None,
             inter_node_gbs: float | None = None) -> Hardware:
    """A device from the table, with optional overrides of its memory and link bandwidths (GB/s)."""
    spec = DEVICES.get(name.lower().replace("ascend", "").replace("-", "").strip())
    if spec is None:
        raise ConfigError(f"--device {name!r} is unknown (known: {', '.join(s.name for s in DEVICES.values())}); "
                          "pick the closest and set --device-memory / --intra-node-bw / --inter-node-bw")
    changes: dict = {}
    if memory:
        changes["memory_bytes"] = parse_bytes(memory)
    if intra_node_gbs:
        changes["intra_node_bw"] = intra_node_gbs * GB
    if inter_node_gbs:
        changes["inter_node_bw"] = inter_node_gbs * GB
    return replace(spec, **changes)


def group_crosses_nodes(layout: Layout, dim: str, devices_per_node: int) -> bool:
    """Whether the process group along mesh dim `dim` spans more than one node (ranks are filled node by node)."""
    order = ("pp", "dp_replicate", "dp_shard", "tp")
    sizes = layout.degrees()
    stride = 1
    for name in order[order.index(dim) + 1:]:
        stride *= sizes[name]
    return sizes[dim] > 1 and stride * sizes[dim] > devices_per_node


def _bandwidth(hw: Hardware, crosses: bool) -> float:
    return hw.inter_node_bw if crosses else hw.intra_node_bw


# Op-level selective checkpointing recomputes only element-wise ops (norms, rotary, SwiGLU): few FLOPs, but
# memory-bound passes over the activations; a small fixed cost stands for them.
SELECTIVE_OPS_RECOMPUTE = 0.03


def recompute_factor(layout: Layout) -> float:
    """Extra compute from activation checkpointing: a recomputed block runs its forward (1/3 of its FLOPs) twice."""
    if layout.ac == "full":
        return 4 / 3
    if layout.ac == "selective":
        if layout.selective_ops:
            return 1 + SELECTIVE_OPS_RECOMPUTE
        return 1 + 1 / (3 * layout.selective_every)
    return 1.0


def pipeline_bubble(layout: Layout) -> float:
    """Fraction of a pipelined step a rank idles: (pp - 1) / (m + pp - 1), the idle part divided by the stages
    per rank for interleaved schedules."""
    if layout.pp == 1:
        return 0.0
    m, pp = layout.n_microbatches, layout.pp
    idle = (pp - 1) / layout.stages_per_rank
    return idle / (m + idle)


@dataclass(frozen=True)
class StepEstimate:
    """Estimated time of one optimizer step and what it is made of (seconds)."""

    step_time: float
    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    fsdp_exposed: float
    offload: float
    tokens_per_step: int
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def estimate_step(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, efficiency: float = 0.4
                  ) -> StepEstimate:
    """Step time of a layout: compute at `efficiency` x peak, plus exposed communication, pipeline bubble, offload."""
    a, c = job.args, job.compute_bytes
    fpt = flops_per_token(a.num_params(exclude_embedding=True), a.n_layers, a.dim, job.seq_len)
    tokens_per_rank = layout.local_batch * job.seq_len  # per data-parallel rank, per step
    tokens_per_step = tokens_per_rank * layout.dp
    flops = fpt * tokens_per_rank * recompute_factor(layout) / (layout.tp * layout.pp)
    compute = flops / (hw.peak_flops * efficiency)

    # Tensor parallel: every block all-gathers its input and reduce-scatters its output (sequence parallel) for
    # attention and the MLP, in forward and again for the gradients in backward; recomputation repeats forward.
    tp_comm = 0.0
    blocks = max(sum(len(p.layers) for p in rank_parts(a, layout, r)) for r in range(layout.pp))
    if layout.tp > 1:
        # 4 collectives per block in forward, 4 in backward, 4 more per recomputed forward (op-level selective
        # checkpointing keeps the reduce-scatters' outputs and repeats only the 2 all-gathers).
        if layout.ac == "selective" and layout.selective_ops:
            per_block = 10
        else:
            per_block = 8 + 12 * (recompute_factor(layout) - 1)
        volume = tokens_per_rank * a.dim * c * per_block * blocks
        bw = _bandwidth(hw, group_crosses_nodes(layout, "tp", devices_per_node))
        tp_comm = volume * (layout.tp - 1) / layout.tp / bw

    # Pipeline: activations and their gradients cross each stage boundary once per micro-batch.
    pp_comm = 0.0
    if layout.pp > 1:
        volume = 2 * tokens_per_rank * a.dim * c / layout.tp * layout.stages_per_rank
        pp_comm = volume / _bandwidth(hw, group_crosses_nodes(layout, "pp", devices_per_node))
    bubble_frac = pipeline_bubble(layout)
    busy = compute + tp_comm + pp_comm
    bubble = busy * bubble_frac / (1 - bubble_frac)

    # FSDP: parameters are all-gathered for forward (and again for backward when resharded) and fp32 gradients
    # reduce-scattered after every forward/backward pass; under pipelining gradients are reduced once per step.
    # HSDP adds an all-reduce over the replicas. Overlapped with compute: only the excess is exposed.
    fsdp_comm = 0.0
    local = local_numel(a, layout, 0)
    reductions = 1 if layout.pp > 1 else layout.passes
    if layout.shards_parameters:
        s = layout.dp_shard
        gathers = (2 if layout.reshard_after_forward else 1) * layout.passes
        bw = _bandwidth(hw, group_crosses_nodes(layout, "dp_shard", devices_per_node))
        fsdp_comm += local * s * (gathers * c + reductions * 4) * (s - 1) / s / bw
        if layout.dp_replicate > 1:
            r = layout.dp_replicate
            bw = _bandwidth(hw, group_crosses_nodes(layout, "dp_replicate", devices_per_node))
            fsdp_comm += local * 4 * 2 * (r - 1) / r / bw * reductions
    elif layout.dp > 1:
        # Replicated data parallelism (fsdp = false, or HSDP with one shard): fp32 gradients all-reduced over dp.
        d = layout.dp
        crosses = layout.dp * layout.tp > devices_per_node
        fsdp_comm += local * 4 * 2 * (d - 1) / d / _bandwidth(hw, crosses) * reductions
    fsdp_exposed = max(0.0, fsdp_comm - compute)

    # cpu_offload: fp32 parameter shards go up before each all-gather and fp32 gradient shards come down after
    # each reduction, not overlapped; AdamW then runs on the host, shared by the node's ranks.
    offload = 0.0
    if layout.cpu_offload:
        gathers = (2 if layout.reshard_after_forward else 1) * layout.passes
        offload = local * 4 * (gathers + reductions) / hw.host_bw + local / HOST_ADAMW_PARAMS_PER_S

    step = compute + tp_comm + pp_comm + bubble + fsdp_exposed + offload
    tokens_per_s = tokens_per_step / step
    mfu = tokens_per_s * fpt / (layout.world_size * hw.peak_flops)
    return StepEstimate(step, compute, tp_comm, pp_comm, bubble, fsdp_exposed, offload, tokens_per_step,
                        tokens_per_s, mfu)

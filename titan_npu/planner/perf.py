"""The analytic step-time model behind the planner's tokens/s ranking.

Compute time is the job's training FLOPs at an assumed fraction of the device's peak; communication time is
bytes over the effective bus bandwidth of the link a process group crosses (intra-node HCCS / NVLink, inter-node
RoCE / InfiniBand). FSDP traffic overlaps with compute, tensor-parallel traffic and the pipeline bubble do not;
nor do expert parallelism's all-to-alls (balanced routing: each token's routed copies leave and return) and context
parallelism's K/V ring or Ulysses all-to-alls, counted whole. A MoE model's FLOPs are those of its active
parameters.
See docs/planning.md for the formulas and their assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_npu.metrics.throughput import flops_per_token
from titan_npu.models.registry import spec_of
from titan_npu.parallel.arithmetic import SPLIT_BACKWARD_SCHEDULES, mesh_dims
from titan_npu.parallel.float8 import wants_float8_all_gather
from titan_npu.planner.activations import offloaded_bytes_per_step
from titan_npu.planner.communication import context_exchange_bytes, context_exchange_parts, expert_all_to_all_bytes
from titan_npu.planner.hardware import Hardware
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.parameters import (
    float8_expert_kinds,
    float8_kinds,
    layers_kinds,
    muon_gather_bytes,
    numel,
    parameter_kinds,
    rank_numel_split,
)
from titan_npu.planner.stages import rank_parts

# Parameters per second one rank's host-side AdamW updates when the node's ranks share the host (cpu_offload).
HOST_ADAMW_PARAMS_PER_S = 0.5e9


def group_crosses_nodes(layout: Layout, dim: str, devices_per_node: int) -> bool:
    """Whether the process group along mesh dim `dim` spans more than one node (ranks are filled node by node)."""
    sizes = layout.mesh_shape()
    names = mesh_dims(sizes)
    stride = 1
    for name in names[names.index(dim) + 1:]:
        stride *= sizes[name]
    return sizes[dim] > 1 and stride * sizes[dim] > devices_per_node


def _bandwidth(hw: Hardware, crosses: bool) -> float:
    return hw.inter_node_bw if crosses else hw.intra_node_bw


# Context parallelism cuts every attention into per-chunk kernels and exchange steps whose launches and
# bookkeeping the bandwidth terms do not see: a CP layout's compute is taken this much slower.
CP_OVERHEAD = 0.03

# Op-level selective checkpointing recomputes only element-wise ops (norms, rotary, SwiGLU): few FLOPs, but
# memory-bound passes over the activations; a small fixed cost stands for them.
SELECTIVE_OPS_RECOMPUTE = 0.03


def recompute_factor(layout: Layout, grouped_share: float = 0.0) -> float:
    """Extra compute from activation checkpointing: a recomputed block runs its forward (1/3 of its FLOPs) twice.

    Op-level selective checkpointing keeps the matmul outputs but not the grouped GEMMs' (not on its list): the
    experts' forward, `grouped_share` of the FLOPs, runs again too.
    """
    if layout.ac == "full":
        return 4 / 3
    if layout.ac == "selective":
        if layout.selective_ops:
            return 1 + SELECTIVE_OPS_RECOMPUTE + grouped_share / 3
        return 1 + 1 / (3 * layout.selective_every)
    return 1.0


def grouped_share(args: object) -> float:
    """The share of a token's matmul FLOPs its routed experts take (0 for a dense model)."""
    experts = spec_of(args).experts
    if experts is None or not experts.n_moe_blocks(args):
        return 0.0
    return experts.routed_active_params(args) / args.num_active_params(exclude_embedding=True)


# float8 GEMMs reach a smaller share of their peak than bf16 ones of theirs: the dynamic-scaling casts (an amax and a
# cast of the input, weight and gradient per linear) are memory-bound passes. torchao's published per-linear
# speed-ups on H100 at large shapes are ~1.5x (tensorwise) and ~1.25x (rowwise) over bf16 for a 2x peak. The MoE
# experts' grouped GEMMs (float8.moe_recipe): rowwise as the rowwise linears; mxfp8 ~1.3x over bf16 grouped GEMMs
# on B200 (torchao's MoE training README: 1.15-1.3x at DeepSeek-V3 shapes, 1.4-1.8x at Llama 4's).
FLOAT8_PEAK_SHARE = {"tensorwise": 0.75, "rowwise": 0.6, "mxfp8": 0.65}


def float8_shares(job: Job) -> tuple[float, float]:
    """(share of a token's training FLOPs in float8 linears, share of the non-expert parameters that are their
    weights); (0, 0) without float8."""
    kinds = float8_kinds(job)
    if not kinds:
        return 0.0, 0.0
    a, shapes = job.args, parameter_kinds(job.args)
    per_layer = layers_kinds(a, range(a.n_layers))
    converted = sum(numel(shapes[k]) for ks in per_layer.values() for k in ks if k in kinds)
    converted += sum(numel(shapes[k]) for k in kinds if not any(k in ks for ks in per_layer.values()))
    dense = sum(numel(shapes[k]) for ks in per_layer.values() for k in ks if not k.startswith("feed_forward.experts."))
    dense += sum(numel(shapes[k]) for k in shapes if not any(k in ks for ks in per_layer.values()))
    return 6.0 * converted / training_flops_per_token(a, job.seq_len), converted / dense


def float8_expert_flops_share(job: Job) -> float:
    """The share of a token's training FLOPs in routed experts whose grouped GEMMs run in float8 (each token's routed
    copies per MoE layer); 0 without float8.moe_experts."""
    kinds = float8_expert_kinds(job)
    if not kinds:
        return 0.0
    a, shapes, experts = job.args, parameter_kinds(job.args), spec_of(job.args).experts
    per_expert = sum(numel(shapes[k]) // shapes[k][0] for k in kinds)
    return (6.0 * experts.n_moe_blocks(a) * experts.routed_copies(a) * per_expert
            / training_flops_per_token(a, job.seq_len))


def training_flops_per_token(args: object, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the active non-embedding parameters plus the token mixing's matmuls, the
    family's count (ModelSpec.training_flops) or the standard one: attention's 12 L D S (metrics/throughput.py,
    what the trainer's MFU counts)."""
    count = spec_of(args).training_flops
    if count is not None:
        return count(args, seq_len)
    active = getattr(args, "num_active_params", args.num_params)(exclude_embedding=True)
    return flops_per_token(active, args.n_layers, args.dim, seq_len)


def pipeline_bubble(layout: Layout) -> float:
    """Fraction of a pipelined step a rank idles, with a stage's backward twice its forward.

    GPipe, 1F1B: (pp - 1) / (m + pp - 1); Interleaved1F1B: the idle part divided by the v stages per rank
    (Narayanan et al. 2021, arXiv:2104.04473, section 2.2). The schedules with a split backward (ZBVZeroBubble,
    DualPipeV, InterleavedZeroBubble) fill the bubble with weight steps: with a chunk's forward, input backward and
    weight backward equally long (F = I = W, so B = I + W = 2F), torch's action order idles a rank pp - 1 chunk
    forwards per step against 3 v m of work: (pp - 1) / (3 v m + pp - 1). That is the zero-bubble paper's ZB-V
    (Qi et al. 2024, arXiv:2401.10241, section 6: near zero when F = I = W) plus the first forward's ramp, and under
    DualPipeV's (PP/2 - 1)(F&B + B - 3W) (DeepSeek's DualPipe notes, github.com/deepseek-ai/DualPipe) with no
    forward/backward overlap (F&B = F + B); tests/tools/test_plan_v_schedules.py replays torch's orders to check it.
    """
    if layout.pp == 1:
        return 0.0
    m, pp, v = layout.n_microbatches, layout.pp, layout.stages_per_rank
    if layout.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        return (pp - 1) / (3 * v * m + pp - 1)
    idle = (pp - 1) / v
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
    ep_comm: float
    cp_comm: float
    optimizer_comm: float  # Muon's gathers of whole matrices in the optimizer step (not overlapped)
    ep_bytes: float  # bytes the busiest rank's expert-parallel all-to-alls send per step
    cp_bytes: float  # bytes a rank's context-parallel exchanges send per step
    tokens_per_step: int
    tokens_per_s: float
    mfu: float
    # activation offload: the host<->device copies of saved activations beyond what compute hides (side stream)
    activation_offload: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def moe_layers(args: object, layers: list[int]) -> int:
    """How many of `layers` are MoE layers (0 for a dense model)."""
    experts = spec_of(args).experts
    return sum(1 for i in layers if experts.moe_block(args, i)) if experts else 0


def pipeline_blocks(args: object, layout: Layout) -> tuple[int, int]:
    """(blocks, MoE blocks) of the pipeline rank that runs the most of each."""
    rank_layers = [[i for p in rank_parts(args, layout, r) for i in p.layers] for r in range(layout.pp)]
    return max(len(layers) for layers in rank_layers), max(moe_layers(args, layers) for layers in rank_layers)


def expert_exchange_seconds(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, tokens: int,
                            layers: int) -> float:
    """Time of expert parallelism's all-to-alls (communication.expert_all_to_all_bytes) over the ep group's link:
    ep consecutive dp_shard ranks, inside a node when ep x cp x tp ranks fit in one."""
    volume = expert_all_to_all_bytes(job, layout, tokens, layers)
    return volume / _bandwidth(hw, layout.ep * layout.cp * layout.tp > devices_per_node) if volume else 0.0


def context_exchange_seconds(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, tokens: int,
                             layers: int) -> float:
    """Time of context parallelism's exchanges (communication.context_exchange_parts) over their groups' links:
    the cp group's; under hybrid, the Ulysses group's (its cp_ulysses adjacent cp ranks) for the all-to-alls."""
    if layout.cp == 1:
        return 0.0
    ulysses, ring = context_exchange_parts(job, layout, tokens, layers)
    crosses = group_crosses_nodes(layout, "cp", devices_per_node)
    inner = crosses if layout.cp_mode == "ulysses" else layout.cp_ulysses * layout.tp > devices_per_node
    return ulysses / _bandwidth(hw, inner) + ring / _bandwidth(hw, crosses)


def estimate_step(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, efficiency: float | None = None
                  ) -> StepEstimate:
    """Step time of a layout: compute at `efficiency` x peak (None: the device type's calibrated efficiency,
    planner/calibration.py), plus exposed communication, pipeline bubble, offload."""
    if efficiency is None:
        from titan_npu.planner.efficiency import calibrated_efficiency

        efficiency = calibrated_efficiency(hw.device_type)
    a, c = job.args, job.compute_bytes
    # What follows from the job alone, once per job.
    fpt, grouped, (f8_flops, f8_params), f8_experts = job.memo("step_shares", lambda: (
        training_flops_per_token(a, job.seq_len), grouped_share(a), float8_shares(job), float8_expert_flops_share(job)))
    tokens_per_rank = layout.local_batch * job.seq_len  # per data-parallel rank, per step
    tokens_per_step = tokens_per_rank * layout.dp
    recompute = recompute_factor(layout, grouped)
    flops = fpt * tokens_per_rank * recompute / (layout.tp * layout.pp * layout.cp)
    # float8 linears (float8.enable) and float8 experts (float8.moe_experts) run at their recipes' shares of the
    # float8 peak (emulation: at the bf16 one); the factor is exactly 1 without float8.
    f8_rate = expert_rate = hw.peak_flops
    if job.float8 is not None and not job.float8.emulate:
        f8_rate = hw.peak_float8_flops * FLOAT8_PEAK_SHARE[job.float8.recipe]
        expert_rate = hw.peak_float8_flops * FLOAT8_PEAK_SHARE[job.float8.moe_recipe]
    float8_factor = ((1 - f8_flops - f8_experts) + f8_flops * hw.peak_flops / f8_rate
                     + f8_experts * hw.peak_flops / expert_rate)
    compute = flops / (hw.peak_flops * efficiency) * float8_factor * (1 + CP_OVERHEAD if layout.cp > 1 else 1)
    blocks, moe_blocks = job.memo(("pipeline_blocks", layout.sharding), lambda: pipeline_blocks(a, layout))
    # A pipeline runs at its busiest rank's pace: where the stages are unequal (n_layers not a multiple of them), the
    # rank with the most blocks computes that many against the mean of n_layers / pp (1 for an even split).
    compute *= blocks * layout.pp / a.n_layers

    # Tensor parallel: every block all-gathers its input and reduce-scatters its output (sequence parallel) for
    # attention and the MLP, in forward and again for the gradients in backward; recomputation repeats forward.
    tp_comm = 0.0
    if layout.tp > 1:
        # 4 collectives per block in forward, 4 in backward, 4 more per recomputed forward (op-level selective
        # checkpointing keeps the reduce-scatters' outputs and repeats only the 2 all-gathers).
        if layout.ac == "selective" and layout.selective_ops:
            per_block = 10
        else:
            per_block = 8 + 12 * (recompute - 1)
        volume = tokens_per_rank // layout.cp * a.dim * c * per_block * blocks
        bw = _bandwidth(hw, group_crosses_nodes(layout, "tp", devices_per_node))
        tp_comm = volume * (layout.tp - 1) / layout.tp / bw

    # Pipeline: activations and their gradients cross each stage boundary once per micro-batch.
    pp_comm = 0.0
    if layout.pp > 1:
        volume = 2 * tokens_per_rank * a.dim * c / layout.tp * layout.stages_per_rank
        pp_comm = volume / _bandwidth(hw, group_crosses_nodes(layout, "pp", devices_per_node))
    bubble_frac = pipeline_bubble(layout)
    ep_comm = expert_exchange_seconds(job, layout, hw, devices_per_node, tokens_per_rank, moe_blocks)
    ep_bytes = expert_all_to_all_bytes(job, layout, tokens_per_rank, moe_blocks)
    cp_comm = context_exchange_seconds(job, layout, hw, devices_per_node, tokens_per_rank // layout.cp, blocks)
    cp_bytes = context_exchange_bytes(job, layout, tokens_per_rank // layout.cp, blocks)
    busy = compute + tp_comm + pp_comm + ep_comm + cp_comm
    bubble = busy * bubble_frac / (1 - bubble_frac)

    # FSDP: parameters are all-gathered for forward (and again for backward when resharded) and fp32 gradients
    # reduce-scattered after every forward/backward pass; under pipelining gradients are reduced once per step.
    # HSDP adds an all-reduce over the replicas. Overlapped with compute: only the excess is exposed.
    fsdp_comm = 0.0
    dense, expert = rank_numel_split(job, layout, 0)
    local = dense + expert
    reductions = 1 if layout.pp > 1 else layout.passes
    if layout.fsdp_enabled:
        gathers = (2 if layout.reshards_after_forward else 1) * layout.passes
        # Bytes an all-gathered dense element takes: the float8 weights' 1 under FSDP2's float8 all-gather.
        # (An accelerator's backend carries float8, parallel/float8.py.)
        gather_float8 = job.float8 is not None and wants_float8_all_gather(job.float8)
        dense_bytes = c - (c - 1) * f8_params if gather_float8 else c
        # FSDP's group is dp_shard x cp flattened (cp innermost, tp ranks apart).
        bw = _bandwidth(hw, layout.fsdp_shards * layout.tp > devices_per_node)
        # Under expert parallelism the experts are gathered and reduced only over the efsdp ranks that share them.
        # Under HSDP with ep = dp_shard x cp the experts are sharded over the replicas instead (no all-reduce).
        hsdp_experts = layout.ep > 1 and layout.efsdp == 1 and layout.dp_replicate > 1
        expert_group = layout.expert_shards if layout.ep > 1 else layout.fsdp_shards
        for elements, s, size in ((dense, layout.fsdp_shards, dense_bytes), (expert, expert_group, c)):
            fsdp_comm += elements * s * (gathers * size + reductions * 4) * (s - 1) / s / bw
        if layout.dp_replicate > 1:
            r = layout.dp_replicate
            bw = _bandwidth(hw, group_crosses_nodes(layout, "dp_replicate", devices_per_node))
            fsdp_comm += (dense if hsdp_experts else local) * 4 * 2 * (r - 1) / r / bw * reductions
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
        gathers = (2 if layout.reshards_after_forward else 1) * layout.passes
        offload = local * 4 * (gathers + reductions) / hw.host_bw + local / HOST_ADAMW_PARAMS_PER_S

    # Muon: each update is gathered whole over the ranks that cut its matrix dims, after backward.
    optimizer_comm = muon_gather_bytes(job, layout, 0) / _bandwidth(
        hw, layout.fsdp_shards * layout.tp > devices_per_node)

    # Activation offload: every moved byte crosses the host link twice (out in forward, back before backward) on
    # a side stream; only what the compute does not cover is exposed (PCIe / the NPU's host link: hw.host_bw).
    swap = 0.0
    if layout.act_offload and hw.device_type != "cpu":
        moved = max(offloaded_bytes_per_step(job, layout, r, hw.device_type) for r in range(layout.pp))
        swap = max(0.0, 2 * moved / hw.host_bw - compute)

    step = (compute + tp_comm + pp_comm + bubble + fsdp_exposed + offload + ep_comm + cp_comm + optimizer_comm
            + swap)
    tokens_per_s = tokens_per_step / step
    mfu = tokens_per_s * fpt / (layout.world_size * hw.peak_flops)
    return StepEstimate(step, compute, tp_comm, pp_comm, bubble, fsdp_exposed, offload, ep_comm, cp_comm,
                        optimizer_comm, ep_bytes, cp_bytes, tokens_per_step, tokens_per_s, mfu, swap)

"""Analytic per-rank memory of a Llama training job: what `titan-npu plan` reports before anything is launched.

Parameters, gradients and optimizer state are exact: the planner walks the same parameter shapes, tensor-parallel
placements, pipeline split and FSDP2 dim-0 chunking as the real parallelized model (the dry run checks equality).
Activations count the tensors autograd saves for backward in titan_npu.models.llama with the reference ops, per
token; tests/tools/test_plan_calibration.py holds the count to measured CPU peaks. See docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_npu.config.schema import JobConfig
from titan_npu.errors import LayoutError
from titan_npu.models.llama.args import LlamaArgs, build_model_args

GiB = 1024**3
MiB = 1024**2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
AC_MODES = ("none", "selective", "full")
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
# Mesh dimension order of ParallelDims.build_mesh: a rank's coordinates are its row-major index in this mesh.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# Tensor-parallel placement of each parameter (by name suffix): the dim its local shard cuts, None = replicated.
# Column-wise projections (wq/wk/wv, w1/w3, output) cut their output rows, row-wise ones (wo, w2) their input
# columns, the embedding its vocabulary rows; norms are replicated.
TP_SHARD_DIM: dict[str, int | None] = {
    "tok_embeddings.weight": 0,
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "norm.weight": None,
    "output.weight": 0,
}

# Per-parameter optimizer state, in multiples of the parameter's bytes (moments are kept in the parameter's dtype).
OPTIMIZER_STATE_MULTIPLIER = {"adamw": 2, "adam": 2, "sgd": 1}

# Bytes that the attention kernel keeps per (token, local head) besides q, k, v and the output: the log-sum-exp of
# SDPA's flash/efficient kernels (fp32), or npu_fusion_attention's softmax max and sum (2 x 8 fp32 values).
ATTENTION_STAT_BYTES = {"cpu": 4, "cuda": 4, "npu": 64}

# Device memory the runtime keeps for itself before the allocator sees any (CANN runtime and HCCL workspace on a
# 910B; CUDA context and cuBLAS workspace on a GPU). Assumptions, stated in docs/planning.md.
RUNTIME_RESERVE_BYTES = {"npu": 3 * GiB, "cuda": 1 * GiB, "cpu": 0}
HCCL_BUFFSIZE_DEFAULT_MB = 200  # HCCL's default; each communicator keeps an input and an output buffer of this size
NCCL_COMMUNICATOR_BYTES = 128 * MiB  # NCCL channels' staging buffers per communicator, order of magnitude


@dataclass(frozen=True)
class Layout:
    """How one job is laid out: parallel degrees, activation checkpointing and batch split per rank."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = True
    ac: str = "none"  # none | selective | full
    selective_every: int = 2
    batch_size: int = 1  # sequences per rank per accumulation step (split into pipeline micro-batches when pp > 1)
    grad_accum: int = 1
    pp_microbatches: int = 0  # 0 = 2 * pp
    pp_schedule: str = "1F1B"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    loss_parallel: bool = True
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "batch_size", "grad_accum", "selective_every"):
            if getattr(self, name) < 1:
                raise LayoutError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.ac not in AC_MODES:
            raise LayoutError(f"activation_checkpoint.mode={self.ac!r} is unknown (choose {', '.join(AC_MODES)})")
        if self.pp > 1 and self.batch_size % self.n_microbatches:
            raise LayoutError(
                f"training.batch_size={self.batch_size} does not split into {self.n_microbatches} pipeline "
                f"micro-batches; make batch_size a multiple of parallel.pp_microbatches"
            )

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shards_parameters(self) -> bool:
        """FSDP splits parameters, gradients and optimizer state over dp_shard."""
        return self.fsdp and self.dp_shard > 1

    @property
    def fsdp_wrapped(self) -> bool:
        """fully_shard is applied (also for pure replication over dp_replicate): params cast by FSDP, no autocast."""
        return self.shards_parameters or self.dp_replicate > 1

    @property
    def n_microbatches(self) -> int:
        """Pipeline micro-batches per accumulation step (1 without pipeline parallelism)."""
        if self.pp == 1:
            return 1
        return self.pp_microbatches or 2 * self.pp

    @property
    def micro_batch(self) -> int:
        """Sequences in one forward/backward pass of one stage."""
        return self.batch_size // self.n_microbatches

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def describe(self) -> str:
        """One line: degrees, activation checkpointing and batch split."""
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}", f"pp={self.pp}"]
        if not self.fsdp:
            parts.append("fsdp=off")
        if self.cpu_offload:
            parts.append("cpu_offload")
        ac = f"selective/{self.selective_every}" if self.ac == "selective" else self.ac
        batch = f"batch {self.batch_size}"
        if self.pp > 1:
            batch += f" ({self.n_microbatches} x {self.micro_batch}, {self.pp_schedule})"
        return f"{' '.join(parts)}, AC {ac}, {batch} x accum {self.grad_accum}"


@dataclass(frozen=True)
class Job:
    """What the estimate needs from the config besides the layout."""

    args: LlamaArgs
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    momentum: float = 0.9  # SGD keeps a momentum buffer only when this is non-zero

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def job_from_config(cfg: JobConfig) -> Job:
    """The model and training settings of a config, resolved."""
    return Job(
        args=build_model_args(cfg.model),
        seq_len=cfg.training.seq_len,
        dtype=cfg.training.dtype,
        optimizer=cfg.optimizer.name.lower(),
        momentum=float(cfg.optimizer.betas[0]) if cfg.optimizer.betas else 0.0,
    )


def layout_from_config(cfg: JobConfig, world_size: int) -> Layout:
    """The config's layout on `world_size` ranks (dp_shard = -1 resolved the way ParallelDims does)."""
    from titan_npu.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    p = cfg.parallel
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        fsdp=p.fsdp,
        ac=cfg.activation_checkpoint.mode,
        selective_every=cfg.activation_checkpoint.selective_every,
        batch_size=cfg.training.batch_size,
        grad_accum=cfg.training.gradient_accumulation_steps,
        pp_microbatches=p.pp_microbatches,
        pp_schedule=p.pp_schedule,
        cpu_offload=p.cpu_offload,
        reshard_after_forward=p.reshard_after_forward,
        loss_parallel=p.loss_parallel,
    )


# ---------------------------------------------------------------------------------------------------------------
# Exact parameter, gradient and optimizer-state bytes


BLOCK_KINDS = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
               "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
               "attention_norm.weight", "ffn_norm.weight")


def parameter_kinds(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Full shape of each kind of parameter: the block ones by their name inside a block, then the root ones."""
    d, hd = args.dim, args.head_dim
    q, kv, f, v = args.n_heads * hd, args.n_kv_heads * hd, args.ffn_dim, args.vocab_size
    return {
        "attention.wq.weight": (q, d),
        "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, q),
        "feed_forward.w1.weight": (f, d),
        "feed_forward.w2.weight": (d, f),
        "feed_forward.w3.weight": (f, d),
        "attention_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "tok_embeddings.weight": (v, d),
        "norm.weight": (d,),
        "output.weight": (v, d),
    }


def parameter_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model by its Meta name, with its full (unsharded) shape."""
    kinds = parameter_kinds(args)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": kinds["tok_embeddings.weight"]}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{kind}": kinds[kind] for kind in BLOCK_KINDS})
    shapes["norm.weight"] = kinds["norm.weight"]
    shapes["output.weight"] = kinds["output.weight"]
    return shapes


def parameter_kind(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'attention.wq.weight'; root parameters are their own kind."""
    return name.split(".", 2)[-1] if name.startswith("layers.") else name


def stage_layer_ids(n_layers: int, pp: int) -> list[list[int]]:
    """Transformer blocks of each pipeline stage: contiguous, as even as possible, earlier stages one more."""
    if pp > n_layers:
        raise LayoutError(f"parallel.pp_degree={pp} exceeds model.n_layers={n_layers}; choose pp <= {n_layers}")
    base, extra = divmod(n_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(list(range(start, start + size)))
        start += size
    return stages


def stage_root_kinds(pp: int, stage: int) -> list[str]:
    """Root parameters of a pipeline stage: the embedding on the first, final norm and output on the last."""
    kinds = []
    if stage == 0:
        kinds.append("tok_embeddings.weight")
    if stage == pp - 1:
        kinds += ["norm.weight", "output.weight"]
    return kinds


def stage_parameter_names(args: LlamaArgs, pp: int, stage: int) -> list[str]:
    """Names of the parameters one pipeline stage holds."""
    names = [f"layers.{i}.{kind}" for i in stage_layer_ids(args.n_layers, pp)[stage] for kind in BLOCK_KINDS]
    return names + stage_root_kinds(pp, stage)


def chunk_size(n: int, parts: int, index: int) -> int:
    """Length of torch.chunk(n, parts)[index] (0 past the last chunk): how DTensor and FSDP2 cut a dim."""
    step = -(-n // parts)
    return max(0, min(step, n - index * step))


def rank_coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """A rank's index along each mesh dimension (pp, dp_replicate, dp_shard, tp), as init_device_mesh lays it out."""
    if not 0 <= rank < layout.world_size:
        raise LayoutError(f"rank {rank} is outside a {layout.world_size}-rank job (choose 0..{layout.world_size - 1})")
    coords, rest = {}, rank
    for name in reversed(MESH_DIMS):
        size = layout.degrees()[name]
        coords[name] = rest % size
        rest //= size
    return {name: coords[name] for name in MESH_DIMS}


def local_shape(kind: str, shape: tuple[int, ...], layout: Layout, coords: dict[str, int]) -> tuple[int, ...]:
    """The shape of a parameter's local shard on a rank: tensor-parallel cut first, then FSDP's dim-0 chunk of it."""
    local = list(shape)
    tp_dim = TP_SHARD_DIM[kind]
    if layout.tp > 1 and tp_dim is not None:
        local[tp_dim] = chunk_size(local[tp_dim], layout.tp, coords["tp"])
    if layout.shards_parameters:
        local[0] = chunk_size(local[0], layout.dp_shard, coords["dp_shard"])
    return tuple(local)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def local_parameter_numels(args: LlamaArgs, layout: Layout, rank: int) -> dict[str, int]:
    """Elements of every parameter shard that `rank` holds, by name."""
    coords = rank_coordinates(layout, rank)
    kinds = parameter_kinds(args)
    per_kind = {kind: _numel(local_shape(kind, shape, layout, coords)) for kind, shape in kinds.items()}
    return {name: per_kind[parameter_kind(name)] for name in stage_parameter_names(args, layout.pp, coords["pp"])}


def local_numel(args: LlamaArgs, layout: Layout, rank: int) -> int:
    """Total elements of the parameter shards on `rank` (the sum of local_parameter_numels, without the names)."""
    coords = rank_coordinates(layout, rank)
    kinds = parameter_kinds(args)
    n_blocks = len(stage_layer_ids(args.n_layers, layout.pp)[coords["pp"]])
    block = sum(_numel(local_shape(kind, kinds[kind], layout, coords)) for kind in BLOCK_KINDS)
    root = sum(_numel(local_shape(kind, kinds[kind], layout, coords)) for kind in stage_root_kinds(layout.pp,
                                                                                                 coords["pp"]))
    return n_blocks * block + root


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the training state one rank holds: fp32 parameter shards, their gradients, optimizer moments."""

    parameters: int
    gradients: int
    optimizer: int
    numel: int


def optimizer_state_multiplier(job: Job) -> int:
    """Optimizer state per parameter, in parameter-sized tensors."""
    name = job.optimizer.lower()
    if name not in OPTIMIZER_STATE_MULTIPLIER:
        raise LayoutError(f"optimizer.name={job.optimizer!r} has no state model (known: AdamW, Adam, SGD)")
    if name == "sgd" and job.momentum == 0:
        return 0
    return OPTIMIZER_STATE_MULTIPLIER[name]


def state_bytes(job: Job, layout: Layout, rank: int) -> StateBytes:
    """Exact parameter/gradient/optimizer bytes on `rank` (the model keeps fp32 parameters and fp32 gradients)."""
    numel = local_numel(job.args, layout, rank)
    param = 4 * numel
    return StateBytes(param, param, optimizer_state_multiplier(job) * param, numel)


# ---------------------------------------------------------------------------------------------------------------
# Activations and temporary buffers


def block_activation_bytes(job: Job, layout: Layout, micro_batch: int, device_type: str = "cpu") -> int:
    """Bytes one transformer block saves for backward for one micro-batch (the reference ops' saved tensors).

    Per token: each RMSNorm keeps its fp32 input and normalised value (8 D bytes) and the projection after it keeps
    the normalised output in the compute dtype (c D; with autocast each projection keeps its own copy); attention
    keeps q, k, v and the output (c (2 q + 2 kv)) plus the kernel's softmax statistics; SwiGLU keeps gate, silu(gate),
    up and their product (4 c F). Eager attention keeps the B H S^2 probabilities instead.
    """
    a, c, tp = job.args, job.compute_bytes, layout.tp
    tokens = micro_batch * job.seq_len
    d, hd = a.dim, a.head_dim
    q, kv, f, heads = a.n_heads * hd // tp, a.n_kv_heads * hd // tp, a.ffn_dim // tp, a.n_heads // tp
    sp = tp if (tp > 1 and layout.sequence_parallel) else 1
    autocast = c < 4 and not layout.fsdp_wrapped
    # fp32 norm input + normalised value (+ 4-byte rstd), cut by sequence parallelism; then the projections' inputs.
    norms = 2 * (8 * d + 4) // sp
    norm_outputs = (5 if autocast else 2) * c * d
    ffn = 4 * c * f
    per_token = norms + norm_outputs + ffn
    if a.use_flash_attention:
        per_token += c * (2 * q + 2 * kv) + heads * ATTENTION_STAT_BYTES.get(device_type, 4)
        return tokens * per_token
    # Eager attention: q, repeated k and v, the output, then fp32 probabilities (+ their cast) and a bool mask.
    per_token += 4 * c * q
    probs = micro_batch * heads * job.seq_len**2 * (4 + (c if c != 4 else 0))
    return tokens * per_token + probs + job.seq_len**2


def block_input_bytes(job: Job, layout: Layout, micro_batch: int) -> int:
    """What a fully checkpointed block keeps: its input (the residual stream, fp32 under autocast)."""
    c = job.compute_bytes
    residual = 4 if (c < 4 and not layout.fsdp_wrapped) else c
    sp = layout.tp if (layout.tp > 1 and layout.sequence_parallel) else 1
    return micro_batch * job.seq_len * job.args.dim * residual // sp


def checkpointed_blocks(n_blocks: int, layout: Layout) -> int:
    """How many of a stage's blocks recompute their activations in backward."""
    if layout.ac == "full":
        return n_blocks
    if layout.ac == "selective":
        return n_blocks // layout.selective_every
    return 0


def in_flight_microbatches(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once (1F1B: pp - stage; GPipe: all of them)."""
    if layout.pp == 1:
        return 1
    m = layout.n_microbatches
    if layout.pp_schedule == "GPipe":
        return m
    return min(m, layout.pp - stage)


def loss_bytes(job: Job, layout: Layout, micro_batch: int) -> int:
    """Logits and loss buffers at their peak (backward of the loss): logits (c) + fp32 log-softmax, its grads."""
    vocab = job.args.vocab_size // layout.tp if (layout.tp > 1 and layout.loss_parallel) else job.args.vocab_size
    return micro_batch * job.seq_len * vocab * (job.compute_bytes + 12)


def stage_activation_bytes(job: Job, layout: Layout, stage: int, device_type: str = "cpu") -> int:
    """Saved activations of one pipeline stage at the start of backward, all in-flight micro-batches included."""
    mb = layout.micro_batch
    n_blocks = len(stage_layer_ids(job.args.n_layers, layout.pp)[stage])
    block = block_activation_bytes(job, layout, mb, device_type)
    n_ckpt = checkpointed_blocks(n_blocks, layout)
    per_microbatch = (n_blocks - n_ckpt) * block + n_ckpt * block_input_bytes(job, layout, mb)
    tokens = mb * job.seq_len
    if stage == 0:
        per_microbatch += 8 * tokens  # int64 token ids kept by the embedding
    if stage == layout.pp - 1:
        sp = layout.tp if (layout.tp > 1 and layout.sequence_parallel) else 1
        per_microbatch += tokens * ((8 * job.args.dim + 4) // sp + job.compute_bytes * job.args.dim)  # final norm
    recompute = block if n_ckpt else 0  # one checkpointed block re-runs its forward at a time
    return in_flight_microbatches(layout, stage) * per_microbatch + recompute


@dataclass(frozen=True)
class TemporaryBytes:
    """Buffers that live only during forward/backward (or the optimizer step)."""

    loss: int  # logits and loss on the last stage
    fsdp: int  # unsharded parameters and gradients of the blocks being computed
    autocast: int  # low-precision weight copies autocast keeps for backward (no FSDP mixed precision)
    optimizer_step: int  # foreach optimizer intermediates (after backward, when activations are gone)

    @property
    def during_backward(self) -> int:
        return self.loss + self.fsdp + self.autocast


def temporary_bytes(job: Job, layout: Layout, stage: int, device_type: str = "cpu",
                    local_param_bytes: int = 0) -> TemporaryBytes:
    """Temporary buffers of a stage's rank; local_param_bytes sizes the optimizer step's intermediates."""
    kinds = parameter_kinds(job.args)
    tp, c = layout.tp, job.compute_bytes
    n_blocks = len(stage_layer_ids(job.args.n_layers, layout.pp)[stage])
    block = sum(_numel(kinds[k]) for k in BLOCK_KINDS) // tp
    root_kinds = stage_root_kinds(layout.pp, stage)
    root = sum(_numel(kinds[k]) for k in root_kinds) // tp
    loss = loss_bytes(job, layout, layout.micro_batch) if stage == layout.pp - 1 else 0
    fsdp = autocast = 0
    if layout.fsdp_wrapped:
        # Unsharded copies in the compute dtype: the block being computed and the one prefetched, plus the root
        # (embedding, norm, output), which FSDP2 keeps unsharded between forward and backward. In backward, the
        # block's unsharded gradient (compute dtype) and its fp32 copy for the reduce-scatter.
        grad_copy = 4 if c < 4 else 0
        fsdp = min(n_blocks, 2) * block * c + (block * (c + grad_copy) if n_blocks else 0) + root * c
        if not layout.reshard_after_forward:
            fsdp += max(0, n_blocks - 2) * block * c
    elif c < 4:
        # autocast caches one low-precision copy of every matmul weight for backward (not the embedding table).
        matmuls = n_blocks * sum(_numel(kinds[k]) for k in BLOCK_KINDS if len(kinds[k]) == 2)
        matmuls += _numel(kinds["output.weight"]) if "output.weight" in root_kinds else 0
        autocast = matmuls // tp * c
    # foreach AdamW (the NPU default) materialises sqrt(exp_avg_sq) for every parameter at once; fused kernels
    # (cuda, cpu) need no such buffer.
    optimizer_step = local_param_bytes if device_type == "npu" and optimizer_state_multiplier(job) == 2 else 0
    return TemporaryBytes(loss, fsdp, autocast, optimizer_step)


def communicators(layout: Layout) -> int:
    """Process groups a rank talks over: each mesh dim larger than 1, the flattened dp group and the world group."""
    if layout.world_size == 1:
        return 0
    n = sum(1 for size in layout.degrees().values() if size > 1) + 1
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        n += 1
    return n


def communication_bytes(layout: Layout, device_type: str, hccl_buffsize_mb: int = 0) -> int:
    """Device memory the collective library keeps per rank (HCCL: 2 x HCCL_BUFFSIZE per communicator)."""
    groups = communicators(layout)
    if device_type == "npu":
        return groups * 2 * (hccl_buffsize_mb or HCCL_BUFFSIZE_DEFAULT_MB) * MiB
    if device_type == "cuda":
        return groups * NCCL_COMMUNICATOR_BYTES
    return 0


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-rank device memory of a layout, in bytes, for the busiest pipeline stage."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    communication: int
    runtime: int
    stage: int
    rank: int
    host_offload: int = 0  # bytes moved to host memory by cpu_offload

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.temporary
                + self.communication + self.runtime)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
            "activations": self.activations, "temporary": self.temporary, "communication": self.communication,
            "runtime": self.runtime, "total": self.total, "stage": self.stage, "rank": self.rank,
            "host_offload": self.host_offload,
        }


def stage_rank(layout: Layout, stage: int) -> int:
    """The rank of a stage with coordinate 0 elsewhere: it holds the largest tp/FSDP chunks of that stage."""
    stride = layout.dp_replicate * layout.dp_shard * layout.tp
    return stage * stride


def estimate_memory(job: Job, layout: Layout, device_type: str = "cpu", hccl_buffsize_mb: int = 0,
                    rank: int | None = None) -> MemoryBreakdown:
    """Peak device memory of `rank` (default: the rank with the largest peak over the pipeline stages).

    Peak = state (parameters, gradients, optimizer) + max(activations + backward temporaries, optimizer-step
    temporaries) + collective buffers + runtime reserve. Gradients are counted whole: they exist at the peak
    whenever gradient accumulation runs more than one micro-batch, and a plan must survive that case.
    """
    if rank is not None:
        stages = [rank_coordinates(layout, rank)["pp"]]
    else:
        stages = list(range(layout.pp))
    best: MemoryBreakdown | None = None
    for stage in stages:
        r = stage_rank(layout, stage) if rank is None else rank
        state = state_bytes(job, layout, r)
        acts = stage_activation_bytes(job, layout, stage, device_type)
        temp = temporary_bytes(job, layout, stage, device_type, state.parameters)
        during = max(temp.during_backward, temp.optimizer_step - acts)
        offloaded = state.parameters + state.gradients + state.optimizer if layout.cpu_offload else 0
        breakdown = MemoryBreakdown(
            parameters=0 if layout.cpu_offload else state.parameters,
            gradients=0 if layout.cpu_offload else state.gradients,
            optimizer=0 if layout.cpu_offload else state.optimizer,
            activations=acts,
            temporary=during,
            communication=communication_bytes(layout, device_type, hccl_buffsize_mb),
            runtime=RUNTIME_RESERVE_BYTES.get(device_type, 0),
            stage=stage,
            rank=r,
            host_offload=offloaded,
        )
        if best is None or breakdown.total > best.total:
            best = breakdown
    assert best is not None
    return best


def with_batch(layout: Layout, batch_size: int, grad_accum: int) -> Layout:
    """The same layout with another per-rank batch split."""
    return replace(layout, batch_size=batch_size, grad_accum=grad_accum)


def checkpoint_bytes(job: Job) -> int:
    """Size of one training checkpoint: fp32 weights plus optimizer moments, all ranks together."""
    n = job.args.num_params()
    return 4 * n * (1 + optimizer_state_multiplier(job))

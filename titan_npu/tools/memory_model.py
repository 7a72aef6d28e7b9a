"""Analytic per-rank memory of a training job: what `titan-npu plan` reports before anything is launched.

Parameters, gradients and optimizer state are exact: the planner walks the same parameter shapes and
tensor-parallel placements (the family's ModelSpec.parameter_kinds), pipeline split (ModelSpec.split_layers) and
FSDP2 dim-0 chunking as the real parallelized model; the dry run checks that they are equal. Activations count the
tensors autograd saves for backward in the dense decoder (models/decoder/model.py) with the reference ops, per
token, and walk backward block by block to find the peak (loss buffers, a checkpointed block's recomputation);
tests/tools/test_plan_calibration.py holds them to measured CPU peaks. docs/planning.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from titan_npu.config.schema import JobConfig
from titan_npu.errors import LayoutError
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel.dims import MESH_DIMS

GiB = 1024**3
MiB = 1024**2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
AC_MODES = ("none", "selective", "full")
# Parameters outside the blocks, in the model's order (a pipeline stage holds those of its end of the model).
FIRST_STAGE_KINDS = ("tok_embeddings.weight",)
LAST_STAGE_KINDS = ("norm.weight", "output.weight")

# Per-parameter optimizer state, in parameter-sized tensors (the dry run measures the real optimizer's).
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
    """How one job is laid out: parallel degrees, activation checkpointing and the batch split per rank."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = True
    ac: str = "none"  # none | selective | full
    selective_every: int = 2
    selective_ops: bool = False
    batch_size: int = 1  # training.batch_size: sequences per rank per forward (per accumulation step)
    grad_accum: int = 1
    pp_microbatches: int = 0  # 0 = 2 * pp
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 0  # 0 = 2 for Interleaved1F1B, else 1
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    loss_parallel: bool = True
    loss_chunk_tokens: int = 0  # training.loss_chunk_tokens; 0 = the whole logits at once

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "batch_size", "grad_accum", "selective_every"):
            if getattr(self, name) < 1:
                raise LayoutError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.ac not in AC_MODES:
            raise LayoutError(f"activation_checkpoint.mode={self.ac!r} is unknown (choose {', '.join(AC_MODES)})")
        if self.pp > 1 and self.local_batch % self.n_microbatches:
            raise LayoutError(
                f"{self.local_batch} sequences per pipeline step (batch_size x gradient_accumulation_steps) do not "
                f"split into {self.n_microbatches} micro-batches; make them a multiple of parallel.pp_microbatches"
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
        """FSDP2 (fully_shard or replicate) holds the parameters: it casts them, so no autocast weight copies."""
        return self.dp > 1

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the loss's output projection; 0 = whole logits (always so under TP or PP, as the
        trainer does: titan_npu/trainer/loss.py)."""
        return self.loss_chunk_tokens if self.tp == 1 and self.pp == 1 else 0

    @property
    def sequence_parallel(self) -> bool:
        """The tensor-parallel plan keeps norms and the residual stream split over the sequence."""
        return self.tp > 1

    @property
    def local_batch(self) -> int:
        """Sequences one data-parallel rank processes per optimizer step."""
        return self.batch_size * self.grad_accum

    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        if self.pp_virtual_stages > 0:
            return self.pp_virtual_stages
        return 2 if self.pp_schedule == "Interleaved1F1B" else 1

    @property
    def n_microbatches(self) -> int:
        """Pipeline micro-batches per step: under pipelining the accumulation steps become micro-batches."""
        if self.pp == 1:
            return 1
        return self.pp_microbatches or 2 * self.pp

    @property
    def micro_batch(self) -> int:
        """Sequences in one forward/backward pass of one stage."""
        return self.local_batch // self.n_microbatches if self.pp > 1 else self.batch_size

    @property
    def passes(self) -> int:
        """Forward/backward passes per optimizer step (accumulation steps, or pipeline micro-batches)."""
        return self.n_microbatches if self.pp > 1 else self.grad_accum

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def describe(self) -> str:
        """One line: degrees, activation checkpointing and batch split."""
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}", f"pp={self.pp}"]
        if not self.fsdp:
            parts.append("fsdp=off")
        if self.cpu_offload:
            parts.append("cpu_offload")
        if self.ac == "selective":
            ac = "selective ops" if self.selective_ops else f"selective 1/{self.selective_every}"
        else:
            ac = self.ac
        if self.pp > 1:
            batch = (f"{self.n_microbatches} micro-batches of {self.micro_batch} per step ({self.pp_schedule}, "
                     f"{self.stages_per_rank} stage(s) per rank)")
        else:
            batch = f"micro-batch {self.batch_size} x accum {self.grad_accum}"
        return f"{' '.join(parts)}, AC {ac}, {batch}"


@dataclass(frozen=True)
class Job:
    """What the estimate needs from the config besides the layout."""

    args: Any  # the model's args (models/spec.py)
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
    p, ac = cfg.parallel, cfg.activation_checkpoint
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        fsdp=p.fsdp,
        ac=ac.mode,
        selective_every=ac.selective_every,
        selective_ops=ac.selective_ops,
        batch_size=cfg.training.batch_size,
        grad_accum=cfg.training.gradient_accumulation_steps,
        pp_microbatches=p.pp_microbatches,
        pp_schedule=p.pp_schedule,
        pp_virtual_stages=p.pp_virtual_stages,
        cpu_offload=p.cpu_offload,
        reshard_after_forward=p.reshard_after_forward,
        loss_parallel=p.loss_parallel,
        loss_chunk_tokens=cfg.training.loss_chunk_tokens,
    )


# ---------------------------------------------------------------------------------------------------------------
# Exact parameter, gradient and optimizer-state bytes


def parameter_kinds(args: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of each kind of parameter the model has (its family's table), in the model's order: the block
    ones by their name inside a block, the root ones by their own."""
    return {kind: shape for kind, (shape, _) in spec_of(args).parameter_kinds(args).items()}


def tensor_parallel_dims(args: Any) -> dict[str, int | None]:
    """The dim tensor parallelism splits each kind of parameter along (None = replicated)."""
    return {kind: dim for kind, (_, dim) in spec_of(args).parameter_kinds(args).items()}


def block_kinds(args: Any) -> list[str]:
    """The kinds of parameter one block holds, in the model's order (a rank's parameter names follow it)."""
    return [k for k in parameter_kinds(args) if k not in FIRST_STAGE_KINDS + LAST_STAGE_KINDS]


def parameter_kind(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'attention.wq.weight'; root parameters are their own kind."""
    return name.split(".", 2)[-1] if name.startswith("layers.") else name


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage a rank runs: its blocks and whether it holds the embedding / the norm and output."""

    stage: int
    layers: tuple[int, ...]
    first: bool
    last: bool

    def root_kinds(self, kinds: Collection[str]) -> list[str]:
        """The parameters outside the blocks this stage holds, of those the model has (`kinds`: a tied model
        has no output.weight of its own)."""
        held = (FIRST_STAGE_KINDS if self.first else ()) + (LAST_STAGE_KINDS if self.last else ())
        return [k for k in held if k in kinds]


def rank_parts(args: Any, layout: Layout, pp_rank: int) -> list[StagePart]:
    """The stages pipeline rank `pp_rank` runs (looped: pp_rank, pp_rank + pp, ...), cut as the trainer cuts them."""
    n_stages = layout.pp * layout.stages_per_rank
    if layout.pp == 1:
        return [StagePart(0, tuple(range(args.n_layers)), True, True)]
    layers = spec_of(args).split_layers(args.n_layers, n_stages)
    ids = [pp_rank + i * layout.pp for i in range(layout.stages_per_rank)]
    return [StagePart(i, tuple(layers[i]), i == 0, i == n_stages - 1) for i in ids]


def rank_parameter_names(args: Any, layout: Layout, pp_rank: int) -> list[str]:
    """Names of the parameters a pipeline rank holds (layer names stay global: 'layers.41.attention.wq.weight')."""
    names = []
    kinds = parameter_kinds(args)
    block = block_kinds(args)
    for part in rank_parts(args, layout, pp_rank):
        names += [f"layers.{i}.{kind}" for i in part.layers for kind in block]
        names += part.root_kinds(kinds)
    return names


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


def coordinates_rank(layout: Layout, coords: dict[str, int]) -> int:
    """The rank at the given mesh coordinates (the inverse of rank_coordinates)."""
    rank = 0
    for name in MESH_DIMS:
        rank = rank * layout.degrees()[name] + coords.get(name, 0)
    return rank


def local_shape(shape: tuple[int, ...], tp_dim: int | None, layout: Layout, coords: dict[str, int]
                ) -> tuple[int, ...]:
    """The shape of a parameter's local shard on a rank: tensor-parallel cut first (along tp_dim, None = none),
    then FSDP's dim-0 chunk of it."""
    local = list(shape)
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


def _local_numels(args: Any, layout: Layout, coords: dict[str, int]) -> dict[str, int]:
    """Elements of one local shard of each kind of parameter at `coords`."""
    return {kind: _numel(local_shape(shape, dim, layout, coords))
            for kind, (shape, dim) in spec_of(args).parameter_kinds(args).items()}


def local_parameter_numels(args: Any, layout: Layout, rank: int) -> dict[str, int]:
    """Elements of every parameter shard that `rank` holds, by name."""
    coords = rank_coordinates(layout, rank)
    per_kind = _local_numels(args, layout, coords)
    return {name: per_kind[parameter_kind(name)] for name in rank_parameter_names(args, layout, coords["pp"])}


def local_numel(args: Any, layout: Layout, rank: int) -> int:
    """Total elements of the parameter shards on `rank` (local_parameter_numels summed, without the names)."""
    coords = rank_coordinates(layout, rank)
    per_kind = _local_numels(args, layout, coords)
    block = sum(per_kind[k] for k in block_kinds(args))
    return sum(len(p.layers) * block + sum(per_kind[k] for k in p.root_kinds(per_kind))
               for p in rank_parts(args, layout, coords["pp"]))


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
# Activations


@dataclass(frozen=True)
class BlockBytes:
    """Per micro-batch: what a block saves for backward without checkpointing, and its pieces."""

    full: int  # every tensor autograd saves (no checkpointing)
    block_input: int  # the residual stream entering the block (what full checkpointing keeps)
    op_saves: int  # what op-level selective checkpointing keeps: matmul and attention outputs + the input
    backward_transient: int  # gradients alive while the block's backward runs


def block_bytes(job: Job, layout: Layout, micro_batch: int, device_type: str = "cpu") -> BlockBytes:
    """Saved-tensor bytes of one transformer block for one micro-batch (the reference ops).

    Per token, with c the compute dtype's bytes and sizes local to a tensor-parallel rank: each RMSNorm keeps its
    fp32 input and normalised value (8 D; the cpu reference without TP keeps only its input) and the
    projections after it keep the normalised output (c D; with
    autocast each projection keeps its own low-precision copy); attention keeps q, k, v and its output
    (c (2 q + 2 kv)) plus the kernel's softmax statistics; SwiGLU keeps gate, silu(gate), up and their product
    (4 c F). Eager attention keeps its output copy, repeated k/v and the B H S^2 probabilities instead.
    """
    a, c, tp = job.args, job.compute_bytes, layout.tp
    tokens = micro_batch * job.seq_len
    d, hd = a.dim, a.head_dim
    q, kv, f, heads = a.n_heads * hd // tp, a.n_kv_heads * hd // tp, a.ffn_dim // tp, a.n_heads // tp
    sp = tp if layout.sequence_parallel else 1
    autocast = c < 4 and not layout.fsdp_wrapped
    residual = 4 if autocast else c  # the residual stream stays fp32 under autocast
    stats = heads * ATTENTION_STAT_BYTES.get(device_type, 4)
    if device_type == "cpu" and tp == 1:
        norms = 2 * (residual * d + 4)  # the cpu reference norm (hand-written backward) keeps its input + rstd
    else:
        norms = 2 * (8 * d + 4) // sp  # fp32 input + normalised value + rstd; split over the sequence under SP
    per_token = norms + (5 if autocast else 2) * c * d + 4 * c * f
    if a.use_flash_attention:
        full = tokens * (per_token + c * (2 * q + 2 * kv) + stats)
    else:
        probs = micro_batch * heads * job.seq_len**2 * (4 + (c if c != 4 else 0))
        full = tokens * (per_token + 4 * c * q) + probs + job.seq_len**2
    block_input = tokens * d * residual // sp
    # Op-level selective checkpointing keeps the outputs of every matmul (q, k, v, wo, w1, w3, w2) and of attention.
    op_saves = block_input + tokens * (c * (q + 2 * kv + 2 * d + 2 * f + q) + stats)
    # Measured on CPU: about one fp32 F-wide gradient is alive beyond the saved tensors while a block's backward runs.
    transient = tokens * 4 * f
    return BlockBytes(full, block_input, op_saves, transient)


def checkpoint_kind(layer_id: int, layout: Layout) -> str:
    """How block `layer_id` is checkpointed: 'none', 'full' or 'ops' (activation_checkpoint.py's choice)."""
    if layout.ac == "full":
        return "full"
    if layout.ac == "selective":
        if layout.selective_ops:
            return "ops"
        return "full" if (layer_id + 1) % layout.selective_every == 0 else "none"
    return "none"


def loss_bytes(job: Job, layout: Layout, micro_batch: int) -> int:
    """Logits and loss buffers at their peak (backward of the loss): logits (c), fp32 log-softmax, two fp32 grads."""
    vocab = job.args.vocab_size // layout.tp if (layout.tp > 1 and layout.loss_parallel) else job.args.vocab_size
    return micro_batch * job.seq_len * vocab * (job.compute_bytes + 12)


def logits_bytes(job: Job, layout: Layout, micro_batch: int) -> int:
    """The logits the training step holds through backward."""
    vocab = job.args.vocab_size // layout.tp if (layout.tp > 1 and layout.loss_parallel) else job.args.vocab_size
    return micro_batch * job.seq_len * vocab * job.compute_bytes


def chunked_loss_bytes(job: Job, layout: Layout, micro_batch: int) -> tuple[int, int]:
    """(held, peak) of the chunked loss (trainer/loss.py): it takes both gradients in the forward, so backward
    starts holding the output weight's gradient (the hidden states' one replaces the output's saved input, counted
    with the activations); the peak is a chunk's logits with the fp32 weight-gradient sum, or backward's scaling."""
    a, c = job.args, job.compute_bytes
    tokens, vocab, dim = micro_batch * job.seq_len, a.vocab_size, a.dim
    chunk = min(layout.loss_chunk, tokens)
    autocast = c < 4 and not layout.fsdp_wrapped
    narrow = c if c < 4 else 0  # the low-precision copies the fp32 path does not make
    casts = (tokens + vocab) * dim * c if autocast else 0  # autocast's rounding of the hidden states and weight
    weight_grad = vocab * dim * c
    if narrow:
        # fp32 logits beside the low-precision ones; then the low-precision softmax gradient beside the weight
        # gradient's chunk product, widened to fp32 as it is added to the fp32 sum.
        chunk_peak = max(chunk * vocab * (4 + narrow), chunk * vocab * narrow + vocab * dim * (narrow + 4))
    else:
        chunk_peak = chunk * vocab * 4 + vocab * dim * 4  # the softmax gradient (the logits, in place) and a product
    forward = casts + vocab * dim * 4 + max(chunk_peak, vocab * dim * narrow)
    # Backward of the loss: the held gradients, their scaled copies, and autocast's widening back to fp32.
    backward = 2 * weight_grad + tokens * dim * c + ((vocab + tokens) * dim * 4 if autocast else 0)
    return weight_grad, max(forward, backward)


@dataclass(frozen=True)
class ActivationPeak:
    """A rank's activations at the start of backward and the extra it needs at its backward peak."""

    saved: int  # saved tensors of every in-flight micro-batch
    extra: int  # loss buffers, or a recomputed block with its gradients, at the worst moment of backward


def part_activations(job: Job, layout: Layout, part: StagePart, device_type: str = "cpu") -> ActivationPeak:
    """One micro-batch through one stage: its saved bytes and the peak over a block-by-block walk of backward."""
    mb = layout.micro_batch
    tokens = mb * job.seq_len
    b = block_bytes(job, layout, mb, device_type)
    saved_by, recompute_by = [], []
    for layer in part.layers:
        kind = checkpoint_kind(layer, layout)
        saved_by.append({"none": b.full, "full": b.block_input, "ops": b.op_saves}[kind])
        recompute_by.append({"none": 0, "full": b.full, "ops": max(0, b.full - b.op_saves)}[kind])
    saved = sum(saved_by)
    if part.first:
        saved += 8 * tokens  # int64 token ids kept by the embedding
    if part.last:
        sp = layout.tp if layout.sequence_parallel else 1
        saved += tokens * ((8 * job.args.dim + 4) // sp + job.compute_bytes * job.args.dim)  # final norm, output
    c = job.compute_bytes
    # Backward starts at the loss (last stage) or with the gradient the next stage sent (others).
    if part.last and layout.loss_chunk:
        held, extra = chunked_loss_bytes(job, layout, mb)
    else:
        held = logits_bytes(job, layout, mb) if part.last else tokens * job.args.dim * c
        extra = loss_bytes(job, layout, mb) if part.last else held
    freed = 0  # saved bytes of the blocks whose backward already ran
    for block_saved, recompute in zip(reversed(saved_by), reversed(recompute_by)):
        extra = max(extra, held + recompute + b.backward_transient - freed)
        freed += block_saved
    return ActivationPeak(saved, extra)


def in_flight_forwards(layout: Layout, pp_rank: int) -> int:
    """Stage forwards whose activations a pipeline rank holds at its peak (torch.distributed.pipelining's order).

    1F1B: pp - pp_rank micro-batches; GPipe: all of them; interleaved: the schedule's warm-up forwards plus one.
    """
    if layout.pp == 1:
        return 1
    m, pp, v = layout.n_microbatches, layout.pp, layout.stages_per_rank
    if layout.pp_schedule == "GPipe":
        return m * v
    if v == 1:
        return min(m, pp - pp_rank)
    per_round = m // max(1, m // pp)
    warmup = (v - 1) * per_round + 2 * (pp - 1 - pp_rank)
    return min(warmup + 1, m * v)


def rank_activations(job: Job, layout: Layout, pp_rank: int, device_type: str = "cpu") -> ActivationPeak:
    """Activations of a pipeline rank: its in-flight forwards' saved tensors, plus one backward's peak extra."""
    peaks = [part_activations(job, layout, part, device_type) for part in rank_parts(job.args, layout, pp_rank)]
    largest = max(p.saved for p in peaks)
    return ActivationPeak(in_flight_forwards(layout, pp_rank) * largest, max(p.extra for p in peaks))


# ---------------------------------------------------------------------------------------------------------------
# Temporary and communication buffers, and the per-rank total


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


def temporary_bytes(job: Job, layout: Layout, pp_rank: int, backward_extra: int, device_type: str = "cpu",
                    local_param_bytes: int = 0) -> TemporaryBytes:
    """Temporary buffers of a pipeline rank; local_param_bytes sizes the optimizer step's intermediates."""
    kinds = parameter_kinds(job.args)
    tp, c = layout.tp, job.compute_bytes
    parts = rank_parts(job.args, layout, pp_rank)
    n_blocks = sum(len(p.layers) for p in parts)
    block = sum(_numel(kinds[k]) for k in block_kinds(job.args)) // tp
    root = sum(_numel(kinds[k]) for p in parts for k in p.root_kinds(kinds)) // tp
    fsdp = autocast = 0
    if layout.fsdp_wrapped and layout.pp > 1:
        # Under pipelining the schedule skips FSDP's resharding and gradient reduction until the last micro-batch:
        # every block of the rank stays unsharded (compute dtype) and accumulates an unsharded fp32 gradient.
        fsdp = (n_blocks * block + root) * (c + 4)
    elif layout.fsdp_wrapped:
        # Unsharded copies in the compute dtype: the block being computed and the one prefetched (the last block
        # is never resharded after forward), and the root (embedding, norm, output); in backward, the block's
        # unsharded gradient and its fp32 copy for the reduce-scatter.
        grad_copy = 4 if c < 4 else 0
        fsdp = min(n_blocks, 2) * block * c + (block * (c + grad_copy) if n_blocks else 0) + root * c
        if not layout.reshard_after_forward:
            fsdp += max(0, n_blocks - 2) * block * c
    elif c < 4:
        # autocast caches one low-precision copy of every matmul weight for backward (not the embedding table).
        autocast = n_blocks * sum(_numel(kinds[k]) for k in block_kinds(job.args) if len(kinds[k]) == 2) // tp * c
        if any(p.last for p in parts) and not layout.loss_chunk:  # the chunked loss rounds it itself, briefly
            output = kinds.get("output.weight", kinds["tok_embeddings.weight"])  # tied: the embedding's matrix
            autocast += _numel(output) // tp * c
    # foreach AdamW (the NPU default) materialises sqrt(exp_avg_sq) for every parameter at once; fused kernels
    # (cuda, cpu) need no such buffer.
    optimizer_step = local_param_bytes if device_type == "npu" and optimizer_state_multiplier(job) == 2 else 0
    return TemporaryBytes(backward_extra, fsdp, autocast, optimizer_step)


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
    """Per-rank device memory of a layout, in bytes."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    communication: int
    runtime: int
    rank: int
    pp_rank: int
    host_offload: int = 0  # bytes cpu_offload keeps in host memory instead

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.temporary
                + self.communication + self.runtime)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
            "activations": self.activations, "temporary": self.temporary, "communication": self.communication,
            "runtime": self.runtime, "total": self.total, "rank": self.rank, "pp_rank": self.pp_rank,
            "host_offload": self.host_offload,
        }


def estimate_memory(job: Job, layout: Layout, device_type: str = "cpu", hccl_buffsize_mb: int = 0,
                    rank: int | None = None) -> MemoryBreakdown:
    """Peak device memory of `rank` (default: the rank with the largest peak among the pipeline ranks).

    Peak = state (parameters, gradients, optimizer) + max(activations + backward temporaries, optimizer-step
    temporaries) + collective buffers + runtime reserve. Gradients are counted whole: they exist at the peak
    whenever a step runs more than one forward/backward, and a plan must survive that case.
    """
    if rank is not None:
        candidates = [rank]
    else:
        # Coordinate 0 on every other dim holds the largest tp and FSDP chunks of its pipeline rank.
        candidates = [coordinates_rank(layout, {"pp": r}) for r in range(layout.pp)]
    best: MemoryBreakdown | None = None
    for r in candidates:
        pp_rank = rank_coordinates(layout, r)["pp"]
        state = state_bytes(job, layout, r)
        acts = rank_activations(job, layout, pp_rank, device_type)
        temp = temporary_bytes(job, layout, pp_rank, acts.extra, device_type, state.parameters)
        during = max(temp.during_backward, temp.optimizer_step - acts.saved)
        offload = layout.cpu_offload
        breakdown = MemoryBreakdown(
            parameters=0 if offload else state.parameters,
            gradients=0 if offload else state.gradients,
            optimizer=0 if offload else state.optimizer,
            activations=acts.saved,
            temporary=during,
            communication=communication_bytes(layout, device_type, hccl_buffsize_mb),
            runtime=RUNTIME_RESERVE_BYTES.get(device_type, 0),
            rank=r,
            pp_rank=pp_rank,
            host_offload=state.parameters + state.gradients + state.optimizer if offload else 0,
        )
        if best is None or breakdown.total > best.total:
            best = breakdown
    assert best is not None
    return best


def checkpoint_bytes(job: Job) -> int:
    """Size of one training checkpoint: fp32 weights plus optimizer moments, all ranks together."""
    n = job.args.num_params()
    return 4 * n * (1 + optimizer_state_multiplier(job))

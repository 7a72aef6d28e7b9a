"""Activations: the tensors autograd saves for backward with the reference ops, per token, and a block-by-block walk
of backward for the peak (loss buffers, a checkpointed block's recomputation). Each block's token mixer and
feed-forward terms are its family's (ModelSpec.block_costs: models/decoder/cost.py for the dense decoder's
attention and SwiGLU, models/moe/cost.py for a MoE layer's, the families' own cost.py for theirs); this module adds
what every block shares: its norms, the residual stream, and softmax attention's kernel tensors.
tests/tools/test_plan_calibration.py holds them to measured CPU peaks; docs/planning.md has the formulas. A
context-parallel rank holds seq_len / cp tokens of each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_npu.models.registry import spec_of
from titan_npu.models.spec import BlockCost, CostSite
from titan_npu.parallel.arithmetic import SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.stages import StagePart, rank_parts

# fp32 [S/cp x S/cp] tensors per local head the ring's plain-math block kernel (ops/attention_blocks.py, on a
# device without a fused one) holds at once in its backward: the scores, their exponentials and the gradient.
RING_MATH_BLOCKS = 3
# Devices whose ring blocks run a fused kernel returning its log-sum-exp (ops/attention_blocks.py block_kernels:
# torch's cpu flash kernel, npu_fusion_attention, CUDA's flash / memory-efficient SDPA): no score block is
# materialised.
RING_FUSED_DEVICES = ("cpu", "npu", "cuda")

# Bytes that the attention kernel keeps per (token, local head) besides q, k, v and the output: the log-sum-exp of
# SDPA's flash/efficient kernels (fp32), or npu_fusion_attention's softmax max and sum (2 x 8 fp32 values).
ATTENTION_STAT_BYTES = {"cpu": 4, "cuda": 4, "npu": 64}


@dataclass(frozen=True)
class BlockBytes:
    """Per micro-batch: what a block saves for backward without checkpointing, and its pieces."""

    full: int  # every tensor autograd saves (no checkpointing)
    block_input: int  # the residual stream entering the block (what full checkpointing keeps)
    op_saves: int  # what op-level selective checkpointing keeps: matmul and attention outputs + the input
    backward_transient: int  # gradients alive while the block's backward runs


def local_tokens(job: Job, layout: Layout, micro_batch: int) -> int:
    """Tokens of a micro-batch on one rank: its sequences' seq_len / cp tokens each."""
    return micro_batch * job.seq_len // layout.cp


def cost_site(job: Job, layout: Layout, device_type: str) -> CostSite:
    """Where the job's blocks run under `layout` on `device_type`, as the families' cost terms see it."""
    return CostSite(job.compute_bytes, layout.tp, layout.ep > 1, device_type, job.seq_len)


def block_costs(job: Job) -> list[BlockCost]:
    """Each block's cost terms in layer order (the family's ModelSpec.block_costs), once per job."""
    return job.memo(("block_costs",), lambda: spec_of(job.args).block_costs(job.args))


def block_bytes(job: Job, layout: Layout, micro_batch: int, device_type: str = "cpu",
                block: BlockCost | None = None) -> BlockBytes:
    """Saved-tensor bytes of one transformer block (`block`: its cost terms; the first block's by default) for one
    micro-batch (the reference ops).

    Per token, with c the compute dtype's bytes and sizes local to a tensor-parallel rank: each RMSNorm keeps its
    fp32 input and normalised value (8 D; the cpu reference without TP keeps only its input) and the
    projections after it keep the normalised output (c D; with
    autocast each projection keeps its own low-precision copy); the feed-forward and the token mixer keep their
    family's terms (ModelSpec.block_costs). Softmax attention keeps q, k, v and its output (c (2 q + 2 kv)) plus the
    kernel's softmax statistics besides its mixer's terms; eager attention (and a block whose attention always runs
    the plain path: BlockCost.eager) keeps its output copy, repeated k/v and the B H S^2 probabilities instead.
    q is the query width n_heads x head_dim, kv the key/value width. A mixer that is not softmax attention keeps
    its terms only. Under context parallelism (tokens =
    the rank's seq_len / cp of each sequence) attention keeps what flash attention keeps, whatever
    use_flash_attention says, and two things more per token: the output projection's own copy of attention's
    output (c q: the ring's and Ulysses' outputs come back in another layout, and the reshape before wo copies
    them) and the RoPE rows gathered for the rank's load-balanced positions (fp32 cos and sin, 4 head_dim), both
    measured on CPU (benchmarks/cp_memory.py). The ring's backward (ring_backward_bytes) holds its fp32 dq and
    travelling dk/dv accumulators, the keys/values in flight and one block's gradients; a device without a fused
    block kernel runs plain math, whose fp32 score blocks (RING_MATH_BLOCKS x [S/cp]^2 per local head) are alive
    then too.
    """
    a, c, tp = job.args, job.compute_bytes, layout.tp
    block = block_costs(job)[0] if block is None else block
    site = cost_site(job, layout, device_type)
    tokens = local_tokens(job, layout, micro_batch)
    d = a.dim
    q, kv, heads = a.q_dim // tp, a.kv_dim // tp, a.n_heads // tp
    sp = tp if layout.sequence_parallel else 1
    autocast = c < 4 and not layout.dp_enabled
    residual = 4 if autocast else c  # the residual stream stays fp32 under autocast
    stats = heads * ATTENTION_STAT_BYTES.get(device_type, 4)
    if device_type == "cpu" and tp == 1:
        norms = 2 * (residual * d + 4)  # the cpu reference norm (hand-written backward) keeps its input + rstd
    else:
        norms = 2 * (8 * d + 4) // sp  # fp32 input + normalised value + rstd; split over the sequence under SP
    ffn = block.ffn.bytes(a, site)
    mixer = block.mixer.bytes(a, site)
    per_token = norms + (5 if autocast else 2) * c * d + ffn.saved + mixer.saved
    if not block.softmax:
        full = tokens * per_token
        op_saves = tokens * (d * residual // sp + mixer.op_saves + ffn.op_saves)
        return BlockBytes(full, tokens * d * residual // sp, op_saves, tokens * max(ffn.transient, mixer.transient))
    if layout.cp > 1:
        full = tokens * (per_token + c * (2 * q + 2 * kv) + stats + c * q + 4 * (a.q_dim // a.n_heads))
    elif a.use_flash_attention and not block.eager:
        full = tokens * (per_token + c * (2 * q + 2 * kv) + stats)
    else:
        probs = micro_batch * heads * job.seq_len**2 * (4 + (c if c != 4 else 0))
        full = tokens * (per_token + 4 * c * q) + probs + job.seq_len**2
    block_input = tokens * d * residual // sp
    # Op-level selective checkpointing keeps the outputs of every matmul and of attention (the terms' op_saves).
    op_saves = block_input + tokens * (mixer.op_saves + ffn.op_saves + stats)
    # Measured on CPU: about one fp32 F-wide gradient is alive beyond the saved tensors while a block's backward runs
    # (per routed copy in a MoE block): the feed-forward's transient, or the mixer's where it is larger.
    transient = tokens * max(ffn.transient, mixer.transient)
    if layout.cp > 1 and layout.cp_mode in ("ring", "hybrid"):
        ring = tokens * ring_backward_bytes(q, kv, c)
        if device_type not in RING_FUSED_DEVICES:
            local = job.seq_len // layout.cp
            ring += micro_batch * heads * local * local * 4 * RING_MATH_BLOCKS
        transient = max(transient, ring)
    return BlockBytes(full, block_input, op_saves, transient)


def ring_backward_bytes(q: int, kv: int, c: int) -> int:
    """Per local token, what the ring's backward (parallel/ring_attention.py) holds besides the saved tensors, with
    q / kv the local query and key/value widths: dq's fp32 accumulator (4 q), the dk/dv accumulators held and
    received (2 x 4 x 2 kv, fp32), the keys/values held and received (2 x c 2 kv) and one block's dq, dk, dv
    (c (q + 2 kv)), the fused kernels' own workspace aside."""
    return 4 * q + 16 * kv + 4 * c * kv + c * (q + 2 * kv)


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
    return local_tokens(job, layout, micro_batch) * vocab * (job.compute_bytes + 12)


def logits_bytes(job: Job, layout: Layout, micro_batch: int) -> int:
    """The logits the training step holds through backward."""
    vocab = job.args.vocab_size // layout.tp if (layout.tp > 1 and layout.loss_parallel) else job.args.vocab_size
    return local_tokens(job, layout, micro_batch) * vocab * job.compute_bytes


def chunked_loss_bytes(job: Job, layout: Layout, micro_batch: int) -> tuple[int, int]:
    """(held, peak) of the chunked loss (ops/cross_entropy.py): it takes both gradients in the forward, so backward
    starts holding the output weight's gradient (the hidden states' one replaces the output's saved input, counted
    with the activations); the peak is a chunk's logits with the fp32 weight-gradient sum, or backward's scaling."""
    a, c = job.args, job.compute_bytes
    tokens, vocab, dim = local_tokens(job, layout, micro_batch), a.vocab_size, a.dim
    chunk = min(layout.loss_chunk, tokens)
    autocast = c < 4 and not layout.dp_enabled
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


def tied_output_gradient_bytes(job: Job, layout: Layout) -> int:
    """The output projection's weight gradient that a tied model holds from the loss's backward to the embedding's.

    The matrix is one parameter used twice, so autograd sums the two gradients before accumulating: the first
    waits, whole (its local vocabulary rows under TP), through every block's backward. An untied output
    accumulates at once; the chunked loss holds its gradient anyway.
    """
    if not getattr(job.args, "tie_embeddings", False):
        return 0
    grad = job.compute_bytes if layout.dp_enabled else 4  # FSDP's unsharded parameter's dtype, or fp32
    return job.args.vocab_size // layout.tp * job.args.dim * grad


@dataclass(frozen=True)
class ActivationPeak:
    """A rank's activations at the start of backward and the extra it needs at its backward peak."""

    saved: int  # saved tensors of every in-flight micro-batch
    extra: int  # loss buffers, or a recomputed block with its gradients, at the worst moment of backward
    offloaded: int = 0  # activation offload: bytes one micro-batch moves to host (rank_activations: all in flight)


def offloads(job: Job, layout: Layout, checkpointing: str) -> bool:
    """Whether activation offload moves the saved tensors of a block checkpointed so (`checkpoint_kind`): the kept
    blocks' ('none'), when a micro-batch's residual stream (tokens x dim x compute bytes, the size of most of them)
    reaches offload_min_bytes; the tensors under it (norm statistics, attention's log-sum-exp) are counted moved
    too, a bias of well under 1% of a block's bytes."""
    if not layout.act_offload or checkpointing != "none":
        return False
    tokens = local_tokens(job, layout, layout.micro_batch)
    return tokens * job.args.dim * job.compute_bytes // (layout.tp if layout.sequence_parallel else 1) \
        >= layout.offload_min_bytes


def part_activations(job: Job, layout: Layout, part: StagePart, device_type: str = "cpu",
                     host_apart: bool | None = None) -> ActivationPeak:
    """One micro-batch through one stage: its saved bytes and the peak over a block-by-block walk of backward.

    Activation offload: the moved blocks' saved tensors are on the device only while their backward runs, with
    the block before them prefetched (both counted then); on cpu the host is the device and nothing is saved
    (host_apart: whether host memory is not the device's; None = not on cpu)."""
    mb = layout.micro_batch
    tokens = local_tokens(job, layout, mb)
    walk = block_walk(job, layout, device_type)
    kinds = block_kinds(job, layout, part)
    blocks = [walk[kind] for kind in kinds]
    moved = [block[0] if offloads(job, layout, kind[1]) else 0 for block, kind in zip(blocks, kinds)]
    host_apart = device_type != "cpu" if host_apart is None else host_apart
    away = moved if host_apart else [0] * len(blocks)  # what leaves the device
    saved = sum(block[0] for block in blocks) - sum(away)
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
        held += tied_output_gradient_bytes(job, layout) if part.last else 0
    freed = 0  # saved bytes of the blocks whose backward already ran
    for i in reversed(range(len(blocks))):
        block_saved, recompute, transient = blocks[i]
        back = away[i] + (away[i - 1] if i else 0)  # this block's offloaded tensors and the prefetched ones
        extra = max(extra, held + recompute + transient + back - freed)
        freed += block_saved - away[i]
    return ActivationPeak(saved, extra, sum(moved))


def block_walk(job: Job, layout: Layout, device_type: str) -> dict[tuple[tuple[str, str], str], tuple[int, int, int]]:
    """A block's (saved, recomputed in its backward, backward transient) bytes per micro-batch, by (its
    BlockCost.kind, checkpoint_kind); once per job, layout and device type."""
    return job.memo(("block_walk", layout, device_type), lambda: _block_walk(job, layout, device_type))


def _block_walk(job: Job, layout: Layout, device_type: str) -> dict[tuple[tuple[str, str], str], tuple[int, int, int]]:
    """block_walk, computed."""
    mb = layout.micro_batch
    walk = {}
    for block in {b.kind: b for b in block_costs(job)}.values():
        b = block_bytes(job, layout, mb, device_type, block)
        walk[block.kind, "none"] = (b.full, 0, b.backward_transient)
        walk[block.kind, "full"] = (b.block_input, b.full, b.backward_transient)
        walk[block.kind, "ops"] = (b.op_saves, max(0, b.full - b.op_saves), b.backward_transient)
    return walk


def block_kinds(job: Job, layout: Layout, part: StagePart) -> list[tuple[tuple[str, str], str]]:
    """(BlockCost.kind, checkpoint_kind) of each block of `part`; once per job, blocks and checkpointing settings
    (the layout's ac, selective_ops and selective_every: what checkpoint_kind reads)."""
    key = ("block_kinds", part.layers, layout.ac, layout.selective_ops, layout.selective_every)
    return job.memo(key, lambda: [(block_costs(job)[layer].kind, checkpoint_kind(layer, layout))
                                  for layer in part.layers])


def in_flight_forwards(layout: Layout, pp_rank: int) -> int:
    """Stage forwards whose activations a pipeline rank holds at its peak (torch.distributed.pipelining's order).

    1F1B: pp - pp_rank micro-batches; GPipe: all of them; interleaved: the schedule's warm-up forwards plus one.
    A split backward (ZBVZeroBubble, DualPipeV, InterleavedZeroBubble) frees a forward's activations at its weight
    step, not its input step: ZBVZeroBubble and InterleavedZeroBubble hold 2 pp stage forwards on every rank (each
    stage half a 1F1B stage's layers: 1F1B's first-rank peak, on every rank), DualPipeV one more (the DualPipe notes'
    PP + 1 chunks). tests/tools/test_plan_v_schedules.py replays torch's orders to check these.
    """
    if layout.pp == 1:
        return 1
    m, pp, v = layout.n_microbatches, layout.pp, layout.stages_per_rank
    if layout.pp_schedule == "GPipe":
        return m * v
    if layout.pp_schedule in V_SCHEDULES:
        return sum(v_in_flight_forwards(layout, pp_rank))
    if layout.pp_schedule in SPLIT_BACKWARD_SCHEDULES and v == 2:
        return min(2 * pp, m * v)
    if v == 1:
        return min(m, pp - pp_rank)
    per_round = m // max(1, m // pp)
    warmup = (v - 1) * per_round + 2 * (pp - 1 - pp_rank)
    return min(warmup + 1, m * v)


def v_in_flight_forwards(layout: Layout, pp_rank: int) -> tuple[int, int]:
    """Under a V schedule, the forwards of each of the rank's two stages (stage pp_rank, stage 2 pp - 1 - pp_rank)
    held when their total peaks: 2 pp - 1 - pp_rank (DualPipeV one more) and pp_rank + 1. Rank 0 holds the output
    stage's (the logits) once, its first stage's 2 pp - 1 times."""
    first = 2 * layout.pp - 1 - pp_rank + (layout.pp_schedule == "DualPipeV")
    return min(first, layout.n_microbatches), min(pp_rank + 1, layout.n_microbatches)


def rank_activations(job: Job, layout: Layout, pp_rank: int, device_type: str = "cpu",
                     host_apart: bool | None = None) -> ActivationPeak:
    """Activations of a pipeline rank: its in-flight forwards' saved tensors (under a V schedule each stage's own
    count, else the largest stage's), plus one backward's peak extra (host_apart: part_activations')."""
    peaks = [part_activations(job, layout, part, device_type, host_apart)
             for part in rank_parts(job.args, layout, pp_rank)]
    if layout.pp > 1 and layout.pp_schedule in V_SCHEDULES:
        counts = v_in_flight_forwards(layout, pp_rank)
        saved = sum(n * p.saved for n, p in zip(counts, peaks, strict=True))
        offloaded = sum(n * p.offloaded for n, p in zip(counts, peaks, strict=True))
        return ActivationPeak(saved, max(p.extra for p in peaks), offloaded)
    largest = max(p.saved for p in peaks)
    in_flight = in_flight_forwards(layout, pp_rank)
    return ActivationPeak(in_flight * largest, max(p.extra for p in peaks), in_flight * max(p.offloaded for p in peaks))


def offloaded_bytes_per_step(job: Job, layout: Layout, pp_rank: int, device_type: str = "cpu") -> int:
    """Bytes activation offload moves to host per step on a pipeline rank (each comes back once): every stage of
    the rank, every micro-batch (accumulation step)."""
    parts = rank_parts(job.args, layout, pp_rank)
    return layout.passes * sum(part_activations(job, layout, part, device_type).offloaded for part in parts)

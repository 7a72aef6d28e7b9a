"""Activations: the tensors autograd saves for backward in the dense decoder (models/decoder/model.py) with the
reference ops, per token, and a block-by-block walk of backward for the peak (loss buffers, a checkpointed block's
recomputation). tests/tools/test_plan_calibration.py holds them to measured CPU peaks; docs/planning.md has the
formulas. A MoE layer's feed-forward (models/moe/layer.py) is counted under balanced routing: every token's top_k
copies, whichever rank's experts run them. A context-parallel rank holds seq_len / cp tokens of each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.stages import StagePart, rank_parts

# fp32 [S/cp x S/cp] tensors per local head the ring's plain-math block kernel (ops/attention_blocks.py, on a
# device without a fused one) holds at once in its backward: the scores, their exponentials and the gradient.
RING_MATH_BLOCKS = 3
# Devices whose ring blocks run a fused kernel returning its log-sum-exp (ops/attention_blocks.py block_kernels:
# torch's cpu flash kernel, npu_fusion_attention, CUDA's flash / memory-efficient SDPA): no score block is
# materialised.
RING_FUSED_DEVICES = ("cpu", "npu", "cuda")

# Bytes of the int64 index tensors a MoE layer keeps per routed copy: the sort order, its inverse and the source
# token of each copy (layer.py), and under expert parallelism the exchange's regrouping order (dispatch.py).
MOE_INDEX_BYTES = 24
EP_INDEX_BYTES = 16

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


def moe_ffn_bytes(job: Job, layout: Layout) -> tuple[int, int, int]:
    """Per token, a MoE feed-forward's (saved bytes, bytes op-level checkpointing keeps, backward transient).

    The router keeps its fp32 probabilities (4 E) and top-k indices and weights (16 k); DeepSeek-V3's
    group-limited sigmoid router (group_router.py) keeps the same plus the fp32 copy of its input it scores in
    (4 D, when the input is not fp32 already): its group choice only picks indices, whose graph is freed at once.
    Each of the k routed copies
    keeps its sort indices, the grouped GEMM's input row (c D), gate, silu(gate), up and their product (4 c F_moe,
    as the dense SwiGLU) and its output row for the weighting (c D); a shared expert keeps a dense SwiGLU's
    4 c F_shared. Balanced routing: every rank runs k copies per token, under expert parallelism too (the
    exchange sends and receives as many rows; the received ones are what the grouped GEMM keeps).
    """
    m, c = job.args.moe_args(), job.compute_bytes
    k, d, f, e, shared = m.top_k, m.dim, m.ffn_dim, m.n_experts, m.shared_ffn_dim
    index = MOE_INDEX_BYTES + (EP_INDEX_BYTES if layout.ep > 1 else 0)
    router = 4 * e + 16 * k + (4 * d if m.router == "sigmoid_group" and c < 4 else 0)
    saved = router + k * (index + 2 * c * d + 4 * c * f) + 4 * c * shared
    # Op-level checkpointing keeps the matmul outputs (activation_checkpoint.py's list): the router's logits and the
    # shared expert's projections; the grouped GEMM is not on the list, so the experts are recomputed.
    op_saves = c * e + c * (2 * shared + d if shared else 0)
    transient = k * 4 * f + 4 * shared
    return saved, op_saves, transient


def mla_bytes(job: Job, layout: Layout, device_type: str) -> tuple[int, int]:
    """Per token, what DeepSeek-V3's multi-head latent attention keeps beyond the kernel's q, k, v and output
    (those are H x (qk_nope + qk_rope) wide each, v padded to the query's head width): (saved, op-level saves).

    The compressed query and key/value latents (q_lora_rank r_q, kv_lora_rank r_kv; replicated over tensor-parallel
    ranks) each go through an RMSNorm, which keeps what the block norms keep (fp32 input, normalised value, rstd;
    the cpu reference without TP its input in the projections' dtype and rstd), and the up-projection after it
    keeps its input (c r); wo keeps the copy of attention's output cut back to v_head_dim (c H v). Op-level
    checkpointing keeps the five projections' outputs instead: c (r_q + r_kv + qk_rope + H (qk_nope + v))
    besides q and wo's (counted with the dense attention's). A plain query projection (q_lora_rank 0) has no
    query latent.
    """
    a, c, tp = job.args, job.compute_bytes, layout.tp
    latents = a.q_lora_rank + a.kv_lora_rank
    width = c if device_type == "cpu" and tp == 1 else 8
    norms = width * latents + 4 * (2 if a.q_lora_rank else 1)
    heads = a.n_heads // tp
    saved = norms + c * latents + c * heads * a.v_head_dim
    op_saves = c * (latents + a.qk_rope_head_dim + heads * (a.qk_nope_head_dim + a.v_head_dim))
    return saved, op_saves


def is_mla(args: object) -> bool:
    """Whether a model's attention is multi-head latent attention (DeepSeek-V3)."""
    return hasattr(args, "kv_lora_rank")


def has_sink_attention(args: object) -> bool:
    """Whether the model's attention has sinks / sliding windows (gpt-oss): it runs the plain torch path
    (ops/reference.py: sink_attention), which keeps the B H S^2 probabilities as eager attention does."""
    return hasattr(args, "sliding_window")


def is_hybrid(args: object) -> bool:
    """Whether the model mixes tokens by linear attention in some layers (Qwen3-Next's gated DeltaNet)."""
    return hasattr(args, "linear_n_k_heads")


def linear_attention_bytes(job: Job, tp: int = 1) -> tuple[int, int, int]:
    """Per token, a gated DeltaNet layer's (saved bytes, bytes op-level checkpointing keeps, backward transient),
    in place of attention's, with the reference chunked delta rule (ops/delta_rule.py, chunk C = 64, fp32 inside).

    The projections' outputs (c (2 Kd + 2 Vd + 2 Hv): q, k, v, z, b, a); the convolution's input and its SiLU's
    input and output (c 3 (2 Kd + Vd)); inside the delta rule, fp32 per value head: q and k after the key heads'
    repetition, their L2 norms' inputs, v, k beta, v beta, u, w and the decay-weighted q and k (4 Hv (6 dk + 3 dv)),
    the chunk's pairwise decays, UT system and intra-chunk scores (4 Hv 3 C) and the state entering each chunk
    (4 Hv dk dv / C); the gated norm's fp32 input, z and its product (12 Vd). Op-level checkpointing keeps the
    projections' outputs and the delta rule's output; the transient is the fp32 gradients of the chunk's q, k, v.
    Sizes are a tensor-parallel rank's (its heads).
    """
    a, c, chunk = job.args, job.compute_bytes, 64
    kd, vd, hv = a.linear_key_dim // tp, a.linear_value_dim // tp, a.linear_n_v_heads // tp
    dk, dv = a.linear_k_head_dim, a.linear_v_head_dim
    projections = c * (2 * kd + 2 * vd + 2 * hv)
    saved = (projections + 3 * c * (2 * kd + vd) + 4 * hv * (6 * dk + 3 * dv) + 4 * hv * 3 * chunk
             + 4 * hv * dk * dv // chunk + 12 * vd)
    return saved, projections + c * (vd + a.dim), 4 * hv * (2 * dk + dv)


def block_bytes(job: Job, layout: Layout, micro_batch: int, device_type: str = "cpu", moe: bool = False,
                linear: bool = False) -> BlockBytes:
    """Saved-tensor bytes of one transformer block for one micro-batch (the reference ops).

    Per token, with c the compute dtype's bytes and sizes local to a tensor-parallel rank: each RMSNorm keeps its
    fp32 input and normalised value (8 D; the cpu reference without TP keeps only its input) and the
    projections after it keep the normalised output (c D; with
    autocast each projection keeps its own low-precision copy); attention keeps q, k, v and its output
    (c (2 q + 2 kv)) plus the kernel's softmax statistics; SwiGLU keeps gate, silu(gate), up and their product
    (4 c F). Eager attention keeps its output copy, repeated k/v and the B H S^2 probabilities instead. q is the
    query width n_heads x head_dim (Qwen3 sets head_dim apart from D / n_heads), kv the key/value width.
    Qwen3's per-head q/k RMSNorm keeps what the other norms keep, per (token, head) row and in the projections'
    dtype: its input (c (q + kv)) and rstd (4 per head) with the cpu reference, else the fp32 input and
    normalised value (8 (q + kv)) and rstd; it runs on the heads a tensor-parallel rank holds, so sequence
    parallelism does not split it further. Qwen2's q/k/v biases keep nothing (an add's backward needs no input).
    Sink attention (has_sink_attention: gpt-oss) keeps what eager attention keeps. A linear-attention block
    (`linear`: Qwen3-Next's gated DeltaNet) keeps linear_attention_bytes in place of attention's (its norms and
    feed-forward as any block's); a gated attention block keeps its output gate (c q) besides. A MoE block (`moe`) keeps
    moe_ffn_bytes in place of the SwiGLU's 4 c F; multi-head latent attention
    (DeepSeek-V3) keeps mla_bytes on top of the kernel's q, k, v and output. Under context parallelism (tokens =
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
    tokens = local_tokens(job, layout, micro_batch)
    d = a.dim
    q, kv, f, heads = a.q_dim // tp, a.kv_dim // tp, a.ffn_dim // tp, a.n_heads // tp
    kv_heads = a.n_kv_heads // tp
    sp = tp if layout.sequence_parallel else 1
    autocast = c < 4 and not layout.dp_enabled
    residual = 4 if autocast else c  # the residual stream stays fp32 under autocast
    stats = heads * ATTENTION_STAT_BYTES.get(device_type, 4)
    if device_type == "cpu" and tp == 1:
        norms = 2 * (residual * d + 4)  # the cpu reference norm (hand-written backward) keeps its input + rstd
    else:
        norms = 2 * (8 * d + 4) // sp  # fp32 input + normalised value + rstd; split over the sequence under SP
    if a.qk_norm:
        qk_width = c if device_type == "cpu" and tp == 1 else 8
        norms += qk_width * (q + kv) + 4 * (heads + kv_heads)
    if moe:
        ffn, ffn_op_saves, ffn_transient = moe_ffn_bytes(job, layout)
    else:
        ffn, ffn_op_saves, ffn_transient = 4 * c * f, c * (2 * f + d), 4 * f
    per_token = norms + (5 if autocast else 2) * c * d + ffn
    attn_op_saves = c * (q + 2 * kv + d + q)  # q, k, v, wo and attention's outputs
    if is_mla(a):
        mla, mla_op_saves = mla_bytes(job, layout, device_type)
        per_token += mla
        attn_op_saves = c * (q + d + q) + mla_op_saves
    if linear:
        mixer, mixer_op_saves, mixer_transient = linear_attention_bytes(job, tp)
        full = tokens * (per_token - (qk_width * (q + kv) + 4 * (heads + kv_heads) if a.qk_norm else 0) + mixer)
        op_saves = tokens * (d * residual // sp + mixer_op_saves + ffn_op_saves)
        return BlockBytes(full, tokens * d * residual // sp, op_saves, tokens * max(ffn_transient, mixer_transient))
    if is_hybrid(a):
        per_token += 2 * c * q  # the output gate and the gated output
    if layout.cp > 1:
        full = tokens * (per_token + c * (2 * q + 2 * kv) + stats + c * q + 4 * (a.q_dim // a.n_heads))
    elif a.use_flash_attention and not has_sink_attention(a):
        full = tokens * (per_token + c * (2 * q + 2 * kv) + stats)
    else:
        probs = micro_batch * heads * job.seq_len**2 * (4 + (c if c != 4 else 0))
        full = tokens * (per_token + 4 * c * q) + probs + job.seq_len**2
    block_input = tokens * d * residual // sp
    # Op-level selective checkpointing keeps the outputs of every matmul (q, k, v, wo, w1, w3, w2) and of attention.
    op_saves = block_input + tokens * (attn_op_saves + ffn_op_saves + stats)
    # Measured on CPU: about one fp32 F-wide gradient is alive beyond the saved tensors while a block's backward runs
    # (per routed copy in a MoE block).
    transient = tokens * ffn_transient
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


def part_activations(job: Job, layout: Layout, part: StagePart, device_type: str = "cpu") -> ActivationPeak:
    """One micro-batch through one stage: its saved bytes and the peak over a block-by-block walk of backward."""
    mb = layout.micro_batch
    tokens = local_tokens(job, layout, mb)
    walk = block_walk(job, layout, device_type)
    blocks = [walk[kind] for kind in block_kinds(job, layout, part)]
    saved = sum(block[0] for block in blocks)
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
    for block_saved, recompute, transient in reversed(blocks):
        extra = max(extra, held + recompute + transient - freed)
        freed += block_saved
    return ActivationPeak(saved, extra)


def block_walk(job: Job, layout: Layout, device_type: str) -> dict[tuple[bool, bool, str], tuple[int, int, int]]:
    """A block's (saved, recomputed in its backward, backward transient) bytes per micro-batch, by (MoE block or
    not, linear-attention block or not, checkpoint_kind); once per job, layout and device type."""
    return job.memo(("block_walk", layout, device_type), lambda: _block_walk(job, layout, device_type))


def _block_walk(job: Job, layout: Layout, device_type: str) -> dict[tuple[bool, bool, str], tuple[int, int, int]]:
    """block_walk, computed."""
    mb = layout.micro_batch
    moe_options = ((False, True) if getattr(job.args, "is_moe_layer", None) and getattr(job.args, "n_moe_layers", 1)
                   else (False,))
    linear_options = (False, True) if getattr(job.args, "is_linear_layer", None) else (False,)
    walk = {}
    for is_moe in moe_options:
        for is_linear in linear_options:
            b = block_bytes(job, layout, mb, device_type, moe=is_moe, linear=is_linear)
            walk[is_moe, is_linear, "none"] = (b.full, 0, b.backward_transient)
            walk[is_moe, is_linear, "full"] = (b.block_input, b.full, b.backward_transient)
            walk[is_moe, is_linear, "ops"] = (b.op_saves, max(0, b.full - b.op_saves), b.backward_transient)
    return walk


def block_kinds(job: Job, layout: Layout, part: StagePart) -> list[tuple[bool, bool, str]]:
    """(MoE block or not, linear-attention block or not, checkpoint_kind) of each block of `part`; once per job,
    blocks and checkpointing settings (the layout's ac, selective_ops and selective_every: what checkpoint_kind
    reads)."""
    key = ("block_kinds", part.layers, layout.ac, layout.selective_ops, layout.selective_every)
    is_moe = getattr(job.args, "is_moe_layer", None)
    is_linear = getattr(job.args, "is_linear_layer", None)
    return job.memo(key, lambda: [(bool(is_moe and is_moe(layer)), bool(is_linear and is_linear(layer)),
                                   checkpoint_kind(layer, layout)) for layer in part.layers])


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

"""Plain-torch reference implementation of every op: runs on any device and is what fused kernels are held to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from titan_npu.ops.documents import Documents


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              documents: Documents | None = None) -> torch.Tensor:
    """Fused attention through F.scaled_dot_product_attention; q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D].

    documents: attention stops at their boundaries (a block-diagonal, causal if asked, boolean mask).
    """
    gqa = q.shape[2] != k.shape[2]
    mask = None if documents is None else documents.mask(causal)
    # SDPA wants heads before the sequence: [B, H, S, D].
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal and mask is None,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    documents: Documents | None = None) -> torch.Tensor:
    """The O(S^2)-memory baseline: softmax(Q K^T / sqrt(D) + causal mask) V with the softmax in fp32."""
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), repeat_kv(k, n_rep).transpose(1, 2), repeat_kv(v, n_rep).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)  # [B, H, Sq, Sk]
    if documents is not None:
        scores = scores.masked_fill(~documents.mask(causal), float("-inf"))
    elif causal:
        # Top-left aligned like SDPA's is_causal, so both paths agree for any Sq, Sk.
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   sinks: torch.Tensor | None = None, window: int | None = None,
                   documents: Documents | None = None) -> torch.Tensor:
    """Attention with a learned sink and / or a sliding window (gpt-oss), q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D].

    sinks [Hq]: one more logit per head in the softmax, whose probability is dropped (it takes mass, adds no value);
    window: a query at position i sees the keys i - window < j <= i only. The softmax is in fp32, the scores' row
    maximum (the sink included) subtracted first, as transformers' eager gpt-oss attention computes it.
    """
    n_rep = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), repeat_kv(k, n_rep).transpose(1, 2), repeat_kv(v, n_rep).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * (q.shape[-1] ** -0.5)  # [B, H, Sq, Sk]
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    cols = torch.arange(k.shape[-2], device=q.device)[None, :]
    allowed = documents.mask(causal) if documents is not None else (cols <= rows if causal else None)
    if window is not None:
        band = rows - cols < window
        allowed = band if allowed is None else allowed & band
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key/value head n_rep times along dim 2 ([B,S,Hkv,D] -> [B,S,Hkv*n_rep,D]) for GQA."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, seqlen, n_kv_heads, n_rep, head_dim).reshape(
        bs, seqlen, n_kv_heads * n_rep, head_dim
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32, returned in x.dtype."""
    if x.device.type == "cpu" and type(x) is torch.Tensor and not _is_dtensor(weight):
        return _CpuRMSNorm.apply(x, weight, eps)
    # torch's rms_norm: fused kernels forward and backward on accelerators; DTensors (sequence parallel) know it.
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh")


class _CpuRMSNorm(torch.autograd.Function):
    """RMSNorm with a hand-written backward: torch has no fused rms_norm backward on cpu, and autograd through
    its decomposition runs about 20 element-wise passes per norm where this one runs 7 (0.5-0.8x the time)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32, w32 = x.float(), weight.float()
        mean_sq = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1])
        rstd = mean_sq.add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * w32).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        g32 = grad.float()
        gw = g32 * weight.float()
        # d/dx of x_hat * w: rstd * (gw - x_hat * mean(gw * x_hat)) over the last dim.
        mean_dot = torch.linalg.vecdot(gw, x_hat).unsqueeze(-1).div_(x.shape[-1])
        grad_x = torch.addcmul(gw, x_hat, mean_dot, value=-1).mul_(rstd)
        grad_w = (g32 * x_hat).flatten(0, -2).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.to(x.dtype), grad_w, None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T (no bias)."""
    return F.linear(x, weight)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([B,S,H,D]) by position; cos/sin are [S, D/2] fp32, one angle per interleaved pair (or
    [B, S, D/2]: positions of their own per row, e.g. restarting at each packed document)."""
    return _RotatePairs.apply(xq, cos, sin), _RotatePairs.apply(xk, cos, sin)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_2i, x_2i+1) of [B,S,H,D] x by the angle whose cos/sin [S, D/2] give, in fp32.

    Meta's convention: dims (2i, 2i+1) form the pair rotated by angle pos * theta_i, so Meta weights load as-is
    (the Hugging Face adapter permutes wq/wk rows between this and HF's half-split layout). Eagerly it is one
    complex product, a single vectorised kernel; inductor generates no code for complex tensors (a compiled
    complex product is a chain of eager fallback calls), so compiled graphs take the real form, which fuses into
    one kernel. The two agree within fp32 rounding.
    """
    if torch.compiler.is_compiling():
        return rotate_pairs_real(x, cos, sin)
    return rotate_pairs_complex(x, cos, sin)


def rotate_pairs_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_pairs as complex numbers x_2i + i x_2i+1 times cos + i sin (the eager form)."""
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))  # [B, S, H, D/2]
    rotation = torch.complex(cos.float(), sin.float()).unsqueeze(-2)  # broadcast over the heads (and batch)
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def rotate_pairs_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_pairs as real products, (a c - b s, a s + b c) for each pair (a, b) (the compiled form)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(x.dtype)


class _RotatePairs(torch.autograd.Function):
    """rotate_pairs with its backward written as the inverse rotation (by -angle) of the gradient: one kernel each
    way, eager or compiled."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate_pairs(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return rotate_pairs(grad, cos, -sin), None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: silu(gate) * up."""
    return F.silu(gate) * up


# Element sizes torch._grouped_mm's CPU kernel takes, and the stride alignment it needs (bytes).
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_MM_ALIGNMENT = 16


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
               ) -> torch.Tensor:
    """Rows offsets[g-1]:offsets[g] of x [N, K] times w[g]^T for each group g of w [G, M, K] -> [N, M].

    One kernel: torch._grouped_mm where it runs (CPU, fp32/bf16/fp16, 16-byte aligned rows), otherwise
    padded_grouped_mm, a batched matmul over the groups padded to max_group_rows rows each.
    """
    if grouped_mm_supported(x, w):
        return _eager_grouped_mm(x, w.transpose(-2, -1), offsets)
    return padded_grouped_mm(x, w, offsets, max_group_rows)


@torch.compiler.disable
def _eager_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm, run eagerly under torch.compile: its shape rule there accepts only bf16 (CUDA's)."""
    return torch._grouped_mm(x, w, offs=offsets)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm's CPU kernel takes these operands, backward included: both in one of its dtypes,
    real plain tensors (not fake ones, whose shape rule accepts only bf16: a dry run's), and K and M (row lengths of
    x, w and the gradients) multiples of 16 bytes."""
    from torch._subclasses.fake_tensor import FakeTensor

    if x.device.type != "cpu" or any(_is_dtensor(t) or isinstance(t, FakeTensor) for t in (x, w)):
        return False
    if x.dtype not in GROUPED_MM_DTYPES or w.dtype != x.dtype:
        return False
    size = x.element_size()
    return (w.shape[-1] * size) % GROUPED_MM_ALIGNMENT == 0 and (w.shape[-2] * size) % GROUPED_MM_ALIGNMENT == 0


def padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
                      ) -> torch.Tensor:
    """grouped_mm as one batched matmul: each group's rows scattered into a [G, R, K] buffer (R = max_group_rows,
    at least the largest group; default all N rows), multiplied, gathered back. Costs G x R x K memory."""
    n_rows, groups = x.shape[0], w.shape[0]
    rows = n_rows if max_group_rows is None else max_group_rows
    row = torch.arange(n_rows, device=x.device)
    ends = offsets.long()
    group = torch.searchsorted(ends, row, right=True).clamp_(max=groups - 1)
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    slot = row - starts[group]
    buffer = x.new_zeros(groups, rows, x.shape[1]).index_put((group, slot), x)
    return torch.bmm(buffer, w.transpose(1, 2))[group, slot]


def moe_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice: (softmax of logits [T, E] in fp32, with its gradient; the top_k experts of each token
    [T, top_k] int64, by descending probability)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return probs, torch.topk(probs, top_k, dim=-1).indices


def moe_permute(x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token copies sorted by expert: (routed [T * k, D], order [T * k] int64) for x [T, D] and experts [T, k];
    order is the stable sort of the flattened experts (within an expert, token order) and routed[i] is
    x[order[i] // k]."""
    order = torch.argsort(experts.reshape(-1), stable=True)
    # index_select, not x[...]: its backward is one index_add_ where advanced indexing's zero-fills a buffer and
    # runs index_put_(accumulate=True), about twice the time on the CPU.
    return x.index_select(0, order // experts.shape[-1]), order


class _WeightedCombine(torch.autograd.Function):
    """moe_unpermute's arithmetic with a backward that keeps two [T * k, D] temporaries where autograd's keeps four:
    the output's gradient gathered once to the copies, its dot product with each copy (the weights' gradient, no
    [T * k, D] product kept for a reduction), and the same gather scaled in place (the copies' gradient)."""

    @staticmethod
    def forward(ctx, routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        token = order // weights.shape[-1]
        copy_weights = weights.reshape(-1).index_select(0, order)
        ctx.save_for_backward(routed, order, token, copy_weights)
        ctx.weights_shape = weights.shape
        out = routed.new_zeros(weights.shape[0], routed.shape[-1])
        return out.index_add_(0, token, routed * copy_weights.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        routed, order, token, copy_weights = ctx.saved_tensors
        grad_copies = grad.index_select(0, token)
        grad_copy_weights = torch.linalg.vecdot(grad_copies, routed)
        grad_weights = torch.empty_like(grad_copy_weights).index_copy_(0, order, grad_copy_weights)
        return grad_copies.mul_(copy_weights.unsqueeze(-1)), None, grad_weights.view(ctx.weights_shape)


def moe_unpermute(routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe_permute's inverse with each token's copies weighted and summed: out[t] = sum_j weights[t, j] *
    routed[i] for the i with order[i] = t * k + j; routed [T * k, D], weights [T, k] -> [T, D] in routed's dtype.

    Each sorted copy is weighted and added into its token's row (index_add_): no inverse permutation, no [T, k, D]
    gather and product. A token's copies are added in expert order, which for top_k <= 2 gives the sum over j bit
    for bit. The backward (_WeightedCombine) gathers the output's gradient to the copies once.
    """
    return _WeightedCombine.apply(routed, order, weights.to(routed.dtype))


# --- DeepSeek Sparse Attention (DSA) -------------------------------------------------------------------------------
# Indices of selected keys are int32 [B, S, topk], each row's keys first and -1 after them (a query that sees fewer
# than topk keys), the convention of torch_npu's npu_lightning_indexer / npu_sparse_flash_attention.


def visible_keys(batch: int, seq: int, device: torch.device, documents: Documents | None = None) -> torch.Tensor:
    """bool [B, S, S]: the keys each query may see (causal, and inside its own document with `documents`)."""
    if documents is not None:
        return documents.mask(True)[:, 0]
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores I [B, S, T] fp32: sum_h weights[b, s, h] ReLU(D^-0.5 q[b, s, h] . k[b, t]) for
    q [B, S, H, D], one key head k [B, T, D] and weights [B, S, H] (fp32, the indexer's H^-0.5 included)."""
    # The order of transformers' products, so that the same weights rank keys the same (ties included).
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * q.shape[-1] ** -0.5
    return torch.matmul(weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)


def top_keys(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [B, S, topk]: each query's top-min(topk, T) keys by `scores` among the `visible` ones, best first, -1
    where it sees fewer keys."""
    ranked = scores.masked_fill(~visible, float("-inf"))
    chosen = ranked.topk(min(topk, ranked.shape[-1]), dim=-1).indices
    indices = torch.where(visible.gather(-1, chosen), chosen, -1).to(torch.int32)
    if topk > indices.shape[-1]:
        indices = F.pad(indices, (0, topk - indices.shape[-1]), value=-1)
    return indices


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int,
                 documents: Documents | None = None) -> torch.Tensor:
    """The lightning indexer's selection: top_keys of indexer_scores among the causally visible keys (within each
    query's document with `documents`), int32 [B, S, topk]."""
    visible = visible_keys(q.shape[0], q.shape[1], q.device, documents)
    return top_keys(indexer_scores(q, k, weights), visible, topk)


def selected_mask(indices: torch.Tensor, keys: int) -> torch.Tensor:
    """bool [B, S, keys]: True at the keys `indices` (int [B, S, topk], -1 = none) select."""
    # -1 goes to an extra column that is dropped, so that no entry is written twice.
    index = torch.where(indices < 0, keys, indices).long()
    mask = torch.zeros(*indices.shape[:-1], keys + 1, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, index, True)[..., :keys]


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                     use_flash: bool = True) -> torch.Tensor:
    """Attention of q [B, S, H, D] over the keys of k [B, T, H, D] / v [B, T, H, Dv] that `indices` select for each
    query (int [B, S, topk], shared by the heads) -> [B, S, H, Dv], scale D^-0.5; use_flash=False: the eager
    softmax in fp32."""
    mask = selected_mask(indices, k.shape[1]).unsqueeze(1)
    if use_flash:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Mean over the queries of KL(target || softmax(scores)) over `keys` (bool [B, S, T]); target [B, S, T] sums
    to 1 over them, scores fp32."""
    log_q = torch.log_softmax(scores.masked_fill(~keys, float("-inf")), dim=-1)
    terms = torch.where(keys & (target > 0), target * (target.clamp(min=1e-30).log() - log_q), 0.0)
    return terms.sum(-1).mean()


@torch.no_grad()
def head_summed_probs(q: torch.Tensor, k: torch.Tensor, keys: torch.Tensor, heads_at_once: int = 16
                      ) -> torch.Tensor:
    """The main attention's probabilities over `keys` (bool [B, S, T]) summed over the heads and L1-normalised:
    [B, S, T] fp32, without gradient (a few heads at a time)."""
    total = torch.zeros(keys.shape, dtype=torch.float32, device=q.device)
    mask = keys.unsqueeze(1)
    for h in range(0, q.shape[2], heads_at_once):
        qh, kh = q[:, :, h:h + heads_at_once].transpose(1, 2), k[:, :, h:h + heads_at_once].permute(0, 2, 3, 1)
        scores = torch.matmul(qh.float(), kh.float()) * q.shape[-1] ** -0.5
        total += torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).sum(1)
    return total / total.sum(-1, keepdim=True)



def indexer_warmup_loss(q: torch.Tensor, k: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                        weights: torch.Tensor, rope_dim: int, documents: Documents | None = None) -> torch.Tensor:
    """DSA's dense warm-up loss: mean over the queries of KL(p || softmax(I)) over every key a query sees (causal,
    within its document), p the main attention's probabilities (q, k [B, S, H, D], scale D^-0.5, the last rope_dim
    channels the RoPE ones) summed over the heads and L1-normalised, without gradient; I = indexer_scores(q_index,
    k_index, weights), the gradient flowing to those three."""
    keys = visible_keys(q.shape[0], q.shape[1], q.device, documents)
    return indexer_kl(head_summed_probs(q, k, keys), indexer_scores(q_index, k_index, weights), keys)

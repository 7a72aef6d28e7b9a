"""Ascend fused kernels from torch_npu behind the op dispatch: tensors on an "npu" device use these.

Each function takes and returns exactly what its reference in ops/reference.py does; tests hold every one to
the reference, forward and backward. torch_npu is looked up at call time, so this module imports (and the
backend registers) on machines without it. Every limit a call relies on is the API reference's in the torch_npu
wheel (torch_npu/_op_plugin_docs.py), listed with its source in docs/npu.md.

DTensor inputs (tensor-parallel regions) run the kernel on each rank's local shards where the op is local under
their placements -- the cases the wheel's own DTensor sharding rules (torch_npu/distributed/tensor/_math_ops.py,
_attention.py) shard: rms_norm over rows split on dims before the normalised one, rotary and attention split on
batch or heads, swiglu split alike on both halves -- and the result is wrapped back with the same placements; other
placements take the reference. The MoE kernels are handed local shards by the MoE layer itself.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titan_npu.errors import DeviceError
from titan_npu.ops import reference
from titan_npu.ops.dispatch import register_backend

if TYPE_CHECKING:
    from titan_npu.ops.documents import Documents

log = logging.getLogger("titan_npu")

# npu_fusion_attention's causal modes take this fixed-size upper-triangular mask (True = masked) and read it along
# its diagonals, whatever the sequence length.
CAUSAL_MASK_SIZE = 2048
# sparse_mode 2 = leftUpCausal: query i sees keys 0..i, the same top-left alignment as SDPA's is_causal (mode 3,
# rightDownCausal, would differ whenever the query and key lengths differ).
SPARSE_MODE_LEFT_UP_CAUSAL = 2
# npu_rotary_mul's documented limits in interleave mode: B * N below 1000, an even head size below 896.
ROTARY_INTERLEAVE_MAX_BN = 1000
ROTARY_MAX_HEAD_DIM = 896
# npu_fusion_attention's variable-length (TND) layout takes at most this many sequences per call (the API reference
# gives both 2K and 1K; the stricter holds): more documents are attended in several calls.
VARLEN_MAX_SEQUENCES = 1024

# model.rope_fp32: npu_rotary_mul runs on fp32 q/k and tables and the result is cast back (how torchtitan-npu runs
# RoPE; the reference rotary computes in fp32 too); off (default): in the activations' dtype, without the casts.
_rope_fp32 = False

_causal_masks: dict[torch.device, torch.Tensor] = {}
_rotary_refused: set[tuple[int, int]] = set()  # (B * N, D) shapes the kernel raised on


def _torch_npu() -> ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise DeviceError(
            "the npu kernels need torch_npu, which is not importable here; install torch_npu (docs/npu.md) or "
            "select the reference kernels (titan_npu.ops.set_kernels('reference'))"
        ) from e


def _any_dtensor(*tensors: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def _shared_placements(tensors: tuple[torch.Tensor, ...], shardable: Callable[[int], bool]):
    """(mesh, placements) when `tensors` are DTensors on one mesh with the same placements, each replicated or
    sharded on a dim `shardable` accepts (so each rank's kernel on its local shards computes its shard of the result);
    None otherwise."""
    from torch.distributed.tensor import DTensor

    if not all(isinstance(t, DTensor) for t in tensors):
        return None
    mesh, placements = tensors[0].device_mesh, tuple(tensors[0].placements)
    if any(t.device_mesh != mesh or tuple(t.placements) != placements for t in tensors[1:]):
        return None
    if not all(p.is_replicate() or (p.is_shard() and shardable(p.dim)) for p in placements):
        return None
    return mesh, placements


def _from_local(local: torch.Tensor, mesh, placements, shape: torch.Size) -> torch.Tensor:
    """The DTensor of global `shape` whose shard on this rank is `local` (a kernel's result on local shards)."""
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 bool upper-triangular mask (True above the diagonal) that the causal sparse modes expect."""
    mask = _causal_masks.get(device)
    if mask is None:
        mask = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device).triu(diagonal=1)
        _causal_masks[device] = mask
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              documents: Documents | None = None) -> torch.Tensor:
    """npu_fusion_attention on q [B,S,Hq,D], k/v [B,S,Hkv,D] in BSND layout; GQA by the kernel's kv-head support.

    documents: the variable-length TND layout, each document a sequence of its own (see document_attention).
    DTensors split on heads (or, without documents, on the batch) run on their local shards.
    """
    if _any_dtensor(q, k, v):
        shardable = (2,) if documents is not None else (0, 2)  # the documents' host ends span the whole batch
        shared = _shared_placements((q, k, v), lambda dim: dim in shardable)
        if shared is None:
            return reference.attention(q, k, v, causal=causal, documents=documents)
        q_local, k_local, v_local = q.to_local(), k.to_local(), v.to_local()
        if q_local.shape[2] * k.shape[2] != k_local.shape[2] * q.shape[2]:  # uneven heads: another GQA grouping
            return reference.attention(q, k, v, causal=causal, documents=documents)
        out = attention(q_local, k_local, v_local, causal=causal, documents=documents)
        return _from_local(out, *shared, (*q.shape[:-1], v.shape[-1]))
    if documents is not None:
        return document_attention(q, k, v, documents, causal)
    kwargs: dict = {"scale": q.shape[-1] ** -0.5, "keep_prob": 1.0}
    if causal:
        kwargs.update(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_MODE_LEFT_UP_CAUSAL)
    # Our [B, S, H, D] is the kernel's BSND, so no transpose; the outputs after the first are softmax statistics.
    return _torch_npu().npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.shape[2], "BSND", **kwargs
    )[0]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, causal: bool
                       ) -> torch.Tensor:
    """npu_fusion_attention in TND layout: the B * S positions flattened (a view of [B, S, H, D]), the documents'
    cumulative ends as actual_seq_qlen / actual_seq_kvlen (host ints from the loader, no read from the device), and
    per document the causal mask of sparse_mode 2 -- how MindSpeed runs packed documents
    (mindspeed/core/context_parallel/dot_product_attention.py: TND with cu_seqlens, sparse_mode 2 when the attention
    mask is reset at document ends without context parallelism or with Ulysses).

    The kernel takes at most VARLEN_MAX_SEQUENCES documents per call: more (many short documents) are cut into runs
    of whole documents, each run one call on its own rows, and the outputs concatenated."""
    b, s, hq, d = q.shape
    q, k, v = q.reshape(b * s, hq, d), k.reshape(b * s, k.shape[2], d), v.reshape(b * s, v.shape[2], d)
    ends = documents.cu_seqlens
    outs, start = [], 0
    for first in range(0, len(ends), VARLEN_MAX_SEQUENCES):
        run = ends[first:first + VARLEN_MAX_SEQUENCES]
        stop = run[-1]
        outs.append(_varlen_attention(q[start:stop], k[start:stop], v[start:stop], [e - start for e in run], causal))
        start = stop
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.view(b, s, hq, d)


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: list[int], causal: bool
                      ) -> torch.Tensor:
    """One npu_fusion_attention call in TND layout: q [T, Hq, D], k/v [T, Hkv, D], the sequences' cumulative ends."""
    kwargs: dict = {"scale": q.shape[-1] ** -0.5, "keep_prob": 1.0, "actual_seq_qlen": ends, "actual_seq_kvlen": ends}
    if causal:
        kwargs.update(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_MODE_LEFT_UP_CAUSAL)
    return _torch_npu().npu_fusion_attention(q, k, v, q.shape[1], "TND", **kwargs)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm (it returns (y, rstd)) with gamma in the input's dtype, as the API reference requires: an fp32
    weight beside bf16 activations (autocast; MLA's latent norms) is cast for the call, its gradient flowing back to
    the fp32 weight. DTensors run on their local shards (_rms_norm_on_shards)."""
    if _any_dtensor(x, weight):
        return _rms_norm_on_shards(x, weight, eps)
    return _torch_npu().npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


def _rms_norm_on_shards(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of a DTensor x split only on dims before the normalised one (sequence parallelism's Shard(1), the
    per-head norms' heads) or replicated, with a replicated weight: the kernel on each rank's rows, as the wheel's
    rule for npu_rms_norm shards it; the weight's gradient is partial over the ranks the rows are split over (the
    rule for npu_rms_norm_backward). Other placements take the reference."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    axis = x.dim() - weight.dim()
    shared = _shared_placements((x,), lambda dim: dim < axis)
    if (shared is None or not isinstance(weight, DTensor) or weight.device_mesh != x.device_mesh
            or not all(p.is_replicate() for p in weight.placements)):
        return reference.rms_norm(x, weight, eps)
    grad_placements = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    out = rms_norm(x.to_local(), weight.to_local(grad_placements=grad_placements), eps)
    return _from_local(out, *shared, x.shape)


def set_rope_fp32(on: bool) -> None:
    """Run RoPE in fp32 on the NPU from now on (model.rope_fp32), or in the activations' dtype."""
    global _rope_fp32
    _rope_fp32 = bool(on)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_rotary_mul in "interleave" mode on Meta's interleaved pairs.

    cos/sin [S, D/2] hold one angle per pair (2i, 2i+1); the kernel wants r1/r2 [1, S, 1, D] (BSND) with that
    angle at both dims of the pair. Per-row tables [B, S, D/2] (positions restarting at documents), shapes outside
    the kernel's documented limits, and any it refuses
    (RuntimeError), take the reference path. DTensors split on batch or heads (where r1/r2 have size 1, so the
    wheel's rule leaves them whole) run on their local shards.
    """
    if _any_dtensor(xq, xk, cos, sin):
        shared = _shared_placements((xq, xk), lambda dim: dim in (0, 2))
        if shared is None or _any_dtensor(cos, sin):
            return reference.apply_rotary_emb(xq, xk, cos, sin)
        q_local, k_local = apply_rotary_emb(xq.to_local(), xk.to_local(), cos, sin)
        return _from_local(q_local, *shared, xq.shape), _from_local(k_local, *shared, xk.shape)
    bn = max(xq.shape[0] * xq.shape[2], xk.shape[0] * xk.shape[2])
    d = xq.shape[-1]
    shape = (bn, d)
    if (bn >= ROTARY_INTERLEAVE_MAX_BN or d >= ROTARY_MAX_HEAD_DIM or d % 2
            or shape in _rotary_refused or cos.dim() != 2):  # per-row positions: the kernel's r1 is 1S1D
        return reference.apply_rotary_emb(xq, xk, cos, sin)
    torch_npu = _torch_npu()
    dtype = torch.float32 if _rope_fp32 else xq.dtype
    r1 = cos.repeat_interleave(2, dim=-1)[None, :, None, :].to(dtype)
    r2 = sin.repeat_interleave(2, dim=-1)[None, :, None, :].to(dtype)
    try:
        return (torch_npu.npu_rotary_mul(xq.to(dtype), r1, r2, rotary_mode="interleave").to(xq.dtype),
                torch_npu.npu_rotary_mul(xk.to(dtype), r1, r2, rotary_mode="interleave").to(xk.dtype))
    except RuntimeError as e:  # what the kernel raises on a shape it does not support
        _rotary_refused.add(shape)
        log.warning("npu_rotary_mul refused B*N=%d, D=%d (%s); this shape takes the reference rotary from now on",
                    bn, d, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return reference.apply_rotary_emb(xq, xk, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """npu_swiglu on [gate, up] concatenated along the last dim: it computes silu(first half) * second half.
    DTensors placed alike (element-wise: any split, e.g. column-parallel's last dim) run on their local shards."""
    if _any_dtensor(gate, up):
        shared = _shared_placements((gate, up), lambda dim: True)
        if shared is None or gate.shape != up.shape:
            return reference.swiglu(gate, up)
        return _from_local(swiglu(gate.to_local(), up.to_local()), *shared, gate.shape)
    return _torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def swiglu_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """npu_swiglu on one projection x @ [w_gate; w_up]^T, whose output is the [gate, up] layout the kernel reads.

    That needs one copy, of the weights (2 x F x D elements) or of the activations (2 x T x F, the cat in swiglu);
    the smaller one is made: the weights once the tokens per call T reach the model dim D. One matmul then replaces
    two forward, and the backward's input gradient is one matmul instead of two and a sum. Parameters and
    checkpoints keep w1 and w3 apart; tensor-parallel (DTensor) weights take the composed path (swiglu's shards).
    """
    if _any_dtensor(x, w_gate, w_up) or x.numel() // x.shape[-1] < w_gate.shape[1]:
        return swiglu(F.linear(x, w_gate), F.linear(x, w_up))
    return _torch_npu().npu_swiglu(F.linear(x, torch.cat((w_gate, w_up))), dim=-1)


# --- mixture of experts ------------------------------------------------------------------------------------------
# Sources (torch_npu 2.13.0 / 2.14.0 wheels, the same text in both): the op schemas in
# torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml, the API reference in torch_npu/_op_plugin_docs.py, the
# shape rules in torch_npu/op_plugin/meta/_meta_registrations.py; npu_grouped_matmul's host side is op-plugin's
# op_plugin/ops/opapi/GroupedMatmulKernelNpuOpApi.cpp (aclnnGroupedMatmul). Each limit below is listed with the
# reference's words in docs/npu.md.
# Autograd: the wheel's libtorch_npu.so carries generated backward nodes for npu_moe_token_permute and
# npu_moe_token_unpermute, none for npu_grouped_matmul, npu_grouped_matmul_add_ or npu_moe_gating_top_k_softmax.

# fp16/bf16: both kernels of the grouped GEMM's forward and backward take them; npu_grouped_matmul_add_ (the weight
# gradient) takes no fp32, so fp32 experts run the reference.
GROUPED_MATMUL_DTYPES = (torch.float16, torch.bfloat16)
# Atlas A2: the stored last axis of each x and weight must be shorter than this (the API reference's InnerLimit).
GROUPED_MATMUL_INNER_LIMIT = 65536
GROUPED_MATMUL_MAX_GROUPS = 1024  # groups per npu_grouped_matmul / npu_grouped_matmul_add_ call
GROUP_TYPE_M = 0  # npu_grouped_matmul's group_type: groups split the rows of x (on A2 only -1 and 0 exist)
GROUP_TYPE_K = 2  # npu_grouped_matmul_add_'s only group_type: groups split the contracted axis
GROUP_LIST_CUMSUM = 0  # group_list_type: group_list holds the groups' cumulative ends
# npu_moe_token_permute / _unpermute: bf16 tokens only, at most 512 experts per token, fewer than 16,777,215
# indices (API reference).
PERMUTE_MAX_TOPK = 512
PERMUTE_MAX_INDICES = 16777215
GATING_MAX_TOPK = 1024  # npu_moe_gating_top_k_softmax: k <= 1024


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """Rows of group g of x [N, K] times weight[g] for weight [G, K, M] (any G; a transposed view is fine), group_list
    the int64 cumulative row ends: npu_grouped_matmul (group_type 0, one output) over at most 1024 groups a call.

    With more groups each call takes a run of them plus, before and after it, the other rows as one group each,
    borrowing the neighbouring experts' weights (a view, no copy); those rows' results are taken from the call that
    owns them. Every call then computes all N rows: the price of a layer with more than 1024 local experts."""
    groups = weight.shape[0]
    if groups <= GROUPED_MATMUL_MAX_GROUPS:
        return _grouped_matmul_call(x, weight, group_list)
    rows = torch.arange(x.shape[0], device=x.device)
    out = None
    for first in range(0, groups, GROUPED_MATMUL_MAX_GROUPS - 2):
        last = min(first + GROUPED_MATMUL_MAX_GROUPS - 2, groups)
        ends = [group_list[first:last]]
        if first > 0:  # the rows before the run: one group on the previous expert's weight
            ends.insert(0, group_list[first - 1:first])
        if last < groups:  # the rows after it: one group on the next expert's weight
            ends.append(group_list.new_full((1,), x.shape[0]))
        y = _grouped_matmul_call(x, weight[max(first - 1, 0):min(last + 1, groups)], torch.cat(ends))
        start = group_list[first - 1] if first > 0 else 0
        mine = ((rows >= start) & (rows < group_list[last - 1])).unsqueeze(-1)
        out = y if out is None else torch.where(mine, y, out)
    return out


def _grouped_matmul_call(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """One npu_grouped_matmul call: one x (not transposed, as the kernel requires), one weight, one output."""
    return _torch_npu().npu_grouped_matmul([x.contiguous()], [weight], group_list=group_list, split_item=3,
                                           group_type=GROUP_TYPE_M, group_list_type=GROUP_LIST_CUMSUM)[0]


def _grouped_weight_grad(grad: torch.Tensor, x: torch.Tensor, group_list: torch.Tensor, groups: int) -> torch.Tensor:
    """[G, M, K] fp32: grad rows of g transposed times x rows of g, by npu_grouped_matmul_add_ accumulating into zeros
    (groups split the contracted token axis; an empty group stays 0), at most 1024 groups a call. A call after the
    first takes a scratch group first, for the rows before its run, whose product is dropped."""
    out = grad.new_zeros(groups, grad.shape[1], x.shape[1], dtype=torch.float32)
    kernel = _torch_npu().npu_grouped_matmul_add_
    kwargs = {"transpose_x": True, "transpose_weight": False, "group_type": GROUP_TYPE_K,
              "group_list_type": GROUP_LIST_CUMSUM}
    kernel(out[:GROUPED_MATMUL_MAX_GROUPS], grad, x, group_list[:GROUPED_MATMUL_MAX_GROUPS], **kwargs)
    for first in range(GROUPED_MATMUL_MAX_GROUPS, groups, GROUPED_MATMUL_MAX_GROUPS - 1):
        last = min(first + GROUPED_MATMUL_MAX_GROUPS - 1, groups)
        part = grad.new_zeros(last - first + 1, grad.shape[1], x.shape[1], dtype=torch.float32)
        kernel(part, grad, x, group_list[first - 1:last], **kwargs)
        out[first:last] = part[1:]
    return out


class _GroupedMatmul(torch.autograd.Function):
    """out rows of group g = x rows of g @ w[g]^T with w [G, M, K] (ours) passed as the [G, K, M] view the kernel
    reads. torch_npu has no backward for the kernel, so the gradients are two more kernel calls: grad_x groups by
    rows (grad @ w[g], npu_grouped_matmul), grad_w by the contracted token axis (grad rows of g ^T @ x rows of g,
    npu_grouped_matmul_add_: on Atlas A2 npu_grouped_matmul has no group_type for that axis)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, group_list)
        return _grouped_matmul(x, w.transpose(1, 2), group_list)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _grouped_matmul(grad, w, group_list) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _grouped_weight_grad(grad, x.contiguous(), group_list, w.shape[0]).to(w.dtype)
        return grad_x, grad_w, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
               ) -> torch.Tensor:
    """npu_grouped_matmul (group_type 0, cumulative int64 group_list) for x [N, K] sorted by group and w [G, M, K],
    split into calls of at most 1024 groups; its backward is npu_grouped_matmul and npu_grouped_matmul_add_. Dtypes
    other than fp16/bf16, DTensors and K or M of 65,536 or more (the kernels' inner-axis limit; the token count is
    never an inner axis here) take the reference."""
    if (_any_dtensor(x, w) or x.dtype not in GROUPED_MATMUL_DTYPES or w.dtype != x.dtype
            or max(w.shape[1], w.shape[2]) >= GROUPED_MATMUL_INNER_LIMIT):
        return reference.grouped_mm(x, w, offsets, max_group_rows)
    return _GroupedMatmul.apply(x, w, offsets.to(torch.int64))


def moe_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts from npu_moe_gating_top_k_softmax on the fp32 logits (softmax then top-k in one kernel; its
    values are not renormalised and carry no gradient, so only its int32 indices are used); the probabilities,
    which the router's weights are gathered from and the balancing loss reads, are torch's differentiable
    softmax."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if _any_dtensor(logits) or logits.dim() != 2 or top_k > GATING_MAX_TOPK:
        return probs, torch.topk(probs, top_k, dim=-1).indices
    experts = _torch_npu().npu_moe_gating_top_k_softmax(logits.detach().float(), k=top_k)[1]
    return probs, experts.long()


def _permute_kernels_take(rows: torch.Tensor, tokens: int, top_k: int) -> bool:
    """Whether npu_moe_token_permute / _unpermute take rows of this dtype for `tokens` tokens of top_k experts."""
    return rows.dtype == torch.bfloat16 and top_k <= PERMUTE_MAX_TOPK and tokens * top_k < PERMUTE_MAX_INDICES


def moe_permute(x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of npu_moe_token_permute (bf16 tokens: each token's copies sorted stably by expert, with the
    kernel's backward) and the order, the stable sort of the flattened experts, computed here: the kernel's
    sorted_indices is where each copy went (the inverse permutation, by the API reference's later entry; its
    earlier entry's example is the sort itself), so the order is not read from it."""
    if _any_dtensor(x) or not _permute_kernels_take(x, x.shape[0], experts.shape[-1]):
        return reference.moe_permute(x, experts)
    routed = _torch_npu().npu_moe_token_permute(x, experts.long())[0]
    return routed, torch.argsort(experts.reshape(-1), stable=True)


def moe_unpermute(routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """npu_moe_token_unpermute with probs = the weights (bf16) and sorted_indices = where each token copy sits in
    routed (the inverse of the order, int32, as the kernel documents it and npu_moe_token_permute returns it): each
    token's copies are weighted and summed; its backward gives the routed rows' and the weights' gradients."""
    if _any_dtensor(routed, weights) or not _permute_kernels_take(routed, weights.shape[0], weights.shape[-1]):
        return reference.moe_unpermute(routed, order, weights)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return _torch_npu().npu_moe_token_unpermute(routed, position.to(torch.int32), probs=weights.to(routed.dtype))


# --- DeepSeek Sparse Attention -------------------------------------------------------------------------------------
# Sources (torch_npu 2.13.0 / 2.14.0 wheels, the same text in both): torch_npu/csrc/aten/
# npu_native_functions_by_codegen.yaml:489 (npu_lightning_indexer), :978 (npu_sparse_flash_attention), :980
# (npu_sparse_flash_attention_grad, an op the yaml does not mark `exposed`, hence torch.ops.npu); the meta functions
# in torch_npu/op_plugin/meta/_meta_registrations.py:283-349, :352-367 and :2442-2487 (indices [B, S1, N2,
# sparse_count] int32; softmax_max / softmax_sum [B, N2, S1, G] fp32 with return_softmax_lse); the API reference in
# torch_npu/_op_plugin_docs.py:1363-1410 and :1466-1520. What the reference leaves open, the vendor's golden code
# pins: the indexer's score sum_h w_h ReLU(q_h . k) with no scale of its own (the formula of Huawei's
# LightningIndexer README in sgl-project/sgl-kernel-npu, csrc/lightning_indexer/README.md; op-plugin's
# test/test_custom_ops/test_npu_lightning_indexer.py, _lightning_indexer). What fills a row that sees fewer keys
# than sparse_count, the vendor says two ways: -1 (_op_plugin_docs.py:14715, the KL-loss example: "把对应的sparse
# indices置为-1") or, in that golden, the masked keys themselves after the visible ones (it sorts the masked scores
# and keeps min(sparse_count, S2) of them; -1 only past S2); indexer_topk takes either and sets every key a query
# cannot see to -1. The attention reads a row's indices up to the first -1, query head h uses key head h // G,
# and sparse_mode 3 (rightDownCausal, :1512) masks selected keys at or past S2 - S1 + i + 1 (Ascend/op-plugin
# test/test_custom_ops/test_npu_sparse_flash_attention.py: cpu_sparse_flash_attention, gather_kv, mask). That golden
# runs attention_mode 2 (MLA-absorb: one latent as key and value, :1573 "KV是同一份"); the call here keeps the
# default attention_mode 0, its own value tensor, because the model's MLA is not absorbed (per-head keys).
# value=None (CANN 9.2 or later: _meta_registrations.py:305-309) stands for that shared latent (the golden's
# `value = key.copy()`); the call here always passes the value.

SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3  # query i of S1 sees keys 0 .. S2 - S1 + i of S2: plain causal when S1 == S2
DSA_DTYPES = (torch.float16, torch.bfloat16)  # both kernels' query/key/value/weights (_op_plugin_docs.py:1377, :1406)
# npu_lightning_indexer's sparse_count: 1-2048 and 3072, 4096, ..., 8192 (_op_plugin_docs.py:1393).
INDEXER_SPARSE_COUNTS = frozenset((*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192))
SPARSE_BLOCK_SIZE = 1  # one key per index

_fallbacks_logged: set[tuple[str, str]] = set()
_sparse_attention_refused: set[tuple[int, int, int]] = set()  # (query heads, key heads, D) the kernel raised on


def _fallback(op: str, reason: str) -> None:
    """Log once per (op, reason) that `op` takes the reference here."""
    if (op, reason) not in _fallbacks_logged:
        _fallbacks_logged.add((op, reason))
        log.info("%s: %s; the reference computes it", op, reason)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int,
                 documents: Documents | None = None) -> torch.Tensor:
    """npu_lightning_indexer (BSND, sparse_mode 3, sparse_count topk) on q [B, S, H, D], the key as its one head
    [B, S, 1, D] and the weights in q's dtype; its indices [B, S, 1, topk] are ours, keys a query cannot see set to
    -1. The kernel scores
    sum_h w_h ReLU(q_h . k) without our D^-0.5, a positive factor common to every key (ReLU(c x) = c ReLU(x)), so
    both rank the keys alike. fp32 (the kernel takes fp16/bf16), documents (TND with per-document lengths is not
    wired), DTensors and a topk the kernel does not offer take the reference."""
    reason = None
    if documents is not None:
        reason = "document masks"
    elif _any_dtensor(q, k, weights):
        reason = "DTensor inputs"
    elif q.dtype not in DSA_DTYPES or k.dtype != q.dtype:
        reason = f"{q.dtype} (the kernel takes fp16/bf16)"
    elif topk not in INDEXER_SPARSE_COUNTS:
        reason = f"top-k {topk} (sparse_count is 1-2048 or a multiple of 1024 up to 8192)"
    if reason is not None:
        _fallback("npu_lightning_indexer", reason)
        return reference.indexer_topk(q, k, weights, topk, documents)
    indices = _torch_npu().npu_lightning_indexer(
        q.contiguous(), k.unsqueeze(2).contiguous(), weights.to(q.dtype).contiguous(), layout_query="BSND",
        layout_key="BSND", sparse_count=topk, sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL)[0].squeeze(2)
    # Keys past the query (masked, so ranked after every visible one) become -1, whichever way the kernel fills.
    last_visible = torch.arange(q.shape[1], device=q.device, dtype=indices.dtype).view(1, -1, 1)
    return torch.where(indices <= last_visible, indices, -1)


class _SparseFlashAttention(torch.autograd.Function):
    """npu_sparse_flash_attention forward (with its softmax statistics) and npu_sparse_flash_attention_grad backward,
    BSND, one index row per key head, sparse_mode 3, one key per index."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
                ) -> torch.Tensor:
        out, softmax_max, softmax_sum = _torch_npu().npu_sparse_flash_attention(
            q, k, v, indices, scale, sparse_block_size=SPARSE_BLOCK_SIZE, layout_query="BSND", layout_kv="BSND",
            sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL, return_softmax_lse=True)
        ctx.save_for_backward(q, k, v, indices, out, softmax_max, softmax_sum)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, indices, out, softmax_max, softmax_sum = ctx.saved_tensors
        _torch_npu()
        dq, dk, dv = torch.ops.npu.npu_sparse_flash_attention_grad(
            q, k, v, indices, grad.contiguous(), out, softmax_max, softmax_sum, ctx.scale, SPARSE_BLOCK_SIZE,
            layout="BSND", sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL)[:3]
        return dq, dk, dv, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """npu_sparse_flash_attention (forward and npu_sparse_flash_attention_grad) on q [B, S, H, D], k / v
    [B, S, H_kv, D] (MLA's per-head keys, the values padded to D by the model), the indices repeated for each key
    head ([B, S, H_kv, topk], contiguous as the kernel requires), scale D^-0.5. fp32, a value head size other than
    D, heads that do not group and DTensors take the reference; so does, from then on, a shape the kernel refuses
    (RuntimeError; the per-head MLA layout is not one the vendor's golden code runs)."""
    reason = None
    shape = (q.shape[2], k.shape[2], q.shape[-1])
    if _any_dtensor(q, k, v, indices):
        reason = "DTensor inputs"
    elif q.dtype not in DSA_DTYPES or not q.dtype == k.dtype == v.dtype:
        reason = f"{q.dtype} (the kernel takes fp16/bf16)"
    elif v.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]:
        reason = "a value head size other than the query's (the kernel's output has the query's shape)"
    elif q.shape[2] % k.shape[2]:
        reason = f"{q.shape[2]} query heads over {k.shape[2]} key heads"
    elif shape in _sparse_attention_refused:
        return reference.sparse_attention(q, k, v, indices)
    if reason is not None:
        _fallback("npu_sparse_flash_attention", reason)
        return reference.sparse_attention(q, k, v, indices)
    per_head = indices.to(torch.int32).unsqueeze(2).expand(-1, -1, k.shape[2], -1).contiguous()
    try:
        return _SparseFlashAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), per_head,
                                           q.shape[-1] ** -0.5)
    except RuntimeError as e:  # what the kernel raises on a layout it does not support
        _sparse_attention_refused.add(shape)
        log.warning("npu_sparse_flash_attention refused %d query heads, %d key heads of %d (%s); this shape takes the "
                    "reference from now on", *shape, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return reference.sparse_attention(q, k, v, indices)


# The dense warm-up's KL loss: npu_dense_lightning_indexer_softmax_lse then npu_dense_lightning_indexer_grad_kl_loss
# (yaml :1029, :1032; _op_plugin_docs.py:14890-15022; meta :2507-2523), whose maths op-plugin's
# test/test_custom_ops/test_npu_dense_lightning_indexer_grad_kl_loss.py pins: p = the main attention's
# exp(scale [q, q_rope] . [k, k_rope] - softmax_max) / softmax_sum, rightDownCausal, averaged over the N1 heads;
# softmax(I) from softmax_max_index / softmax_sum_index, I = sum_h w_h ReLU(q_I,h . k_I) without a scale; loss =
# the SUM over batch, queries and keys of p (log max(p, 1e-8) - log max(softmax(I), 1e-8)), and the gradients of
# q_index, key_index and weights are that sum's.


class _IndexerWarmupLoss(torch.autograd.Function):
    """The kernels' loss divided by B x S (ours is the mean over the queries), their gradients likewise; the
    weights go in with our D_I^-0.5 folded in (softmax is not scale-free), its gradient scaled back."""

    @staticmethod
    def forward(ctx, q_index: torch.Tensor, k_index: torch.Tensor, weights: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor, rope_dim: int) -> torch.Tensor:
        torch_npu = _torch_npu()
        scale, index_scale = q.shape[-1] ** -0.5, q_index.shape[-1] ** -0.5
        # The main attention's softmax statistics [B, H, S, 8] (equal over the last axis), its output unused.
        _, softmax_max, softmax_sum, *_ = torch_npu.npu_fusion_attention(
            q, k, k, q.shape[2], "BSND", scale=scale, keep_prob=1.0, atten_mask=causal_mask(q.device),
            sparse_mode=SPARSE_MODE_LEFT_UP_CAUSAL)
        softmax_max, softmax_sum = softmax_max[..., :1].contiguous(), softmax_sum[..., :1].contiguous()
        key_index = k_index.unsqueeze(2).contiguous()
        scaled = (weights.float() * index_scale).contiguous()
        max_index, sum_index = torch_npu.npu_dense_lightning_indexer_softmax_lse(
            q_index, key_index, scaled, layout="BSND", sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL)
        nope = q.shape[-1] - rope_dim
        d_q_index, d_k_index, d_weights, loss = torch_npu.npu_dense_lightning_indexer_grad_kl_loss(
            q[..., :nope].contiguous(), k[..., :nope].contiguous(), q_index, key_index, scaled, softmax_max,
            softmax_sum, max_index, sum_index, scale, query_rope=q[..., nope:].contiguous(),
            key_rope=k[..., nope:].contiguous(), layout="BSND", sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL)
        queries = q.shape[0] * q.shape[1]
        ctx.save_for_backward(d_q_index / queries, d_k_index.squeeze(2) / queries,
                              d_weights.float() * (index_scale / queries))
        return loss[0] / queries

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        d_q_index, d_k_index, d_weights = ctx.saved_tensors
        return grad * d_q_index, grad * d_k_index, grad * d_weights, None, None, None


def indexer_warmup_loss(q: torch.Tensor, k: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                        weights: torch.Tensor, rope_dim: int, documents: Documents | None = None) -> torch.Tensor:
    """The dense warm-up's KL loss from npu_fusion_attention's softmax statistics (one more forward of the main
    attention, BSND, causal), npu_dense_lightning_indexer_softmax_lse and npu_dense_lightning_indexer_grad_kl_loss
    (BSND, sparse_mode 3; the main q/k split into their no-RoPE and RoPE channels): the loss and the indexer's
    gradients in one kernel, without the [B, H, S, S] probabilities and scores the reference holds. fp32, documents,
    DTensors and per-head keys that do not match the query heads take the reference."""
    reason = None
    if documents is not None:
        reason = "document masks"
    elif _any_dtensor(q, k, q_index, k_index, weights):
        reason = "DTensor inputs"
    elif q.dtype not in DSA_DTYPES or not q.dtype == k.dtype == q_index.dtype == k_index.dtype:
        reason = f"{q.dtype} / {q_index.dtype} (the kernels take fp16/bf16)"
    elif k.shape[2] != q.shape[2]:
        reason = f"{q.shape[2]} query heads over {k.shape[2]} key heads"
    if reason is not None:
        _fallback("npu_dense_lightning_indexer_grad_kl_loss", reason)
        return reference.indexer_warmup_loss(q, k, q_index, k_index, weights, rope_dim, documents)
    return _IndexerWarmupLoss.apply(q_index.contiguous(), k_index.contiguous(), weights, q.detach().contiguous(),
                                    k.detach().contiguous(), rope_dim)


register_backend(
    "npu",
    {"attention": attention, "rms_norm": rms_norm, "apply_rotary_emb": apply_rotary_emb, "swiglu": swiglu,
     "swiglu_linear": swiglu_linear,
     "grouped_mm": grouped_mm, "moe_topk_softmax": moe_topk_softmax, "moe_permute": moe_permute,
     "moe_unpermute": moe_unpermute, "indexer_topk": indexer_topk, "sparse_attention": sparse_attention,
     "indexer_warmup_loss": indexer_warmup_loss},
)

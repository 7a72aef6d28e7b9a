"""Ascend fused kernels from torch_npu behind the op dispatch: tensors on an "npu" device use these.

Each function takes and returns exactly what its reference in ops/reference.py does; tests hold every one to
the reference, forward and backward. torch_npu is looked up at call time, so this module imports (and the
backend registers) on machines without it. Inputs that are DTensors (tensor-parallel regions) take the reference
path: of these kernels, torch_npu registers DTensor sharding rules only for npu_fusion_attention.
"""

from __future__ import annotations

import importlib
import logging
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
    """
    if _any_dtensor(q, k, v):
        return reference.attention(q, k, v, causal=causal, documents=documents)
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
    mask is reset at document ends without context parallelism or with Ulysses)."""
    b, s, hq, d = q.shape
    kwargs: dict = {"scale": d ** -0.5, "keep_prob": 1.0, "actual_seq_qlen": documents.cu_seqlens,
                    "actual_seq_kvlen": documents.cu_seqlens}
    if causal:
        kwargs.update(atten_mask=causal_mask(q.device), sparse_mode=SPARSE_MODE_LEFT_UP_CAUSAL)
    out = _torch_npu().npu_fusion_attention(
        q.reshape(b * s, hq, d), k.reshape(b * s, k.shape[2], d), v.reshape(b * s, v.shape[2], d), hq, "TND",
        **kwargs)[0]
    return out.view(b, s, hq, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm (it returns (y, rstd)); gamma as it is: fp32 gamma beside bf16 activations is taken as such
    (Atlas A2 and later), with no rounding of the weight to bf16 and no cast per call."""
    if _any_dtensor(x, weight):
        return reference.rms_norm(x, weight, eps)
    return _torch_npu().npu_rms_norm(x, weight, epsilon=eps)[0]


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
    (RuntimeError), take the reference path.
    """
    bn = max(xq.shape[0] * xq.shape[2], xk.shape[0] * xk.shape[2])
    d = xq.shape[-1]
    shape = (bn, d)
    if (_any_dtensor(xq, xk) or bn >= ROTARY_INTERLEAVE_MAX_BN or d >= ROTARY_MAX_HEAD_DIM or d % 2
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
    """npu_swiglu on [gate, up] concatenated along the last dim: it computes silu(first half) * second half."""
    if _any_dtensor(gate, up):
        return reference.swiglu(gate, up)
    return _torch_npu().npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def swiglu_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """npu_swiglu on one projection x @ [w_gate; w_up]^T, whose output is the [gate, up] layout the kernel reads.

    That needs one copy, of the weights (2 x F x D elements) or of the activations (2 x T x F, the cat in swiglu);
    the smaller one is made: the weights once the tokens per call T reach the model dim D. One matmul then replaces
    two forward, and the backward's input gradient is one matmul instead of two and a sum. Parameters and
    checkpoints keep w1 and w3 apart; tensor-parallel (DTensor) weights take the composed path.
    """
    if _any_dtensor(x, w_gate, w_up) or x.numel() // x.shape[-1] < w_gate.shape[1]:
        return swiglu(F.linear(x, w_gate), F.linear(x, w_up))
    return _torch_npu().npu_swiglu(F.linear(x, torch.cat((w_gate, w_up))), dim=-1)


# --- mixture of experts ------------------------------------------------------------------------------------------
# Sources (torch_npu 2.13.0 wheel): the op schemas in torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml, the
# API reference in torch_npu/_op_plugin_docs.py, the shape rules in torch_npu/op_plugin/meta/_meta_registrations.py
# (npu_grouped_matmul_meta: a single weight is [E, K, N]; group_type 2 splits the contracted K axis and returns
# [E, M, N]); npu_grouped_matmul's host side is op-plugin's op_plugin/ops/opapi/GroupedMatmulKernelNpuOpApi.cpp
# (aclnnGroupedMatmul).
# Autograd: the wheel's libtorch_npu.so carries generated backward nodes for npu_moe_token_permute and
# npu_moe_token_unpermute, none for npu_grouped_matmul or npu_moe_gating_top_k_softmax.

GROUPED_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Atlas A2: the stored last axis of each x and weight must be shorter than this (the API reference's InnerLimit).
GROUPED_MATMUL_INNER_LIMIT = 65536
GROUP_TYPE_M = 0  # group_type: groups split the rows of x
GROUP_TYPE_K = 2  # group_type: groups split the contracted axis (the weight gradient)
GROUP_LIST_CUMSUM = 0  # group_list_type: group_list holds the groups' cumulative ends
# npu_moe_token_permute / _unpermute: bf16 tokens only, at most 512 experts per token (API reference).
PERMUTE_MAX_TOPK = 512
GATING_MAX_TOPK = 1024  # npu_moe_gating_top_k_softmax: k <= 1024


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, group_type: int
                    ) -> torch.Tensor:
    """npu_grouped_matmul on one x and one weight with one output (split_item 3), group_list cumulative ends."""
    return _torch_npu().npu_grouped_matmul([x], [weight], group_list=group_list, split_item=3, group_type=group_type,
                                           group_list_type=GROUP_LIST_CUMSUM)[0]


class _GroupedMatmul(torch.autograd.Function):
    """out rows of group g = x rows of g @ w[g]^T with w [G, M, K] (ours) passed as the [G, K, M] view the kernel
    reads. torch_npu has no backward for the kernel, so the gradients are two more calls of it: grad_x groups by
    rows (grad @ w[g]), grad_w by the contracted token axis (grad rows of g ^T @ x rows of g, empty groups 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, group_list)
        return _grouped_matmul(x, w.transpose(1, 2), group_list, GROUP_TYPE_M)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _grouped_matmul(grad, w, group_list, GROUP_TYPE_M) if ctx.needs_input_grad[0] else None
        # K-split: x is [M, K] stored as [K, M] (grad's transpose), the weight [K, N] (x): y[g] = grad_g^T x_g.
        grad_w = _grouped_matmul(grad.t(), x, group_list, GROUP_TYPE_K) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
               ) -> torch.Tensor:
    """npu_grouped_matmul (group_type 0, cumulative int64 group_list) for x [N, K] sorted by group and w [G, M, K];
    its backward is npu_grouped_matmul too. Other dtypes, DTensors and K or M of 65,536 or more (the kernel's
    inner-axis limit; the token count is never an inner axis here) take the reference."""
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


def moe_permute(x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_moe_token_permute (bf16 tokens): its sorted_indices are the stable sort of the flattened experts, its
    rows x[sorted_indices // k]; the kernel's own backward sums each token's copies."""
    if _any_dtensor(x) or x.dtype != torch.bfloat16 or experts.shape[-1] > PERMUTE_MAX_TOPK:
        return reference.moe_permute(x, experts)
    routed, order = _torch_npu().npu_moe_token_permute(x, experts.long())
    return routed, order.long()


def moe_unpermute(routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """npu_moe_token_unpermute with probs = the weights (bf16): routed row i goes back to copy order[i] and each
    token's copies are weighted and summed; its backward gives the routed rows' and the weights' gradients."""
    if _any_dtensor(routed, weights) or routed.dtype != torch.bfloat16 or weights.shape[-1] > PERMUTE_MAX_TOPK:
        return reference.moe_unpermute(routed, order, weights)
    return _torch_npu().npu_moe_token_unpermute(routed, order.to(torch.int32), probs=weights.to(routed.dtype))


register_backend(
    "npu",
    {"attention": attention, "rms_norm": rms_norm, "apply_rotary_emb": apply_rotary_emb, "swiglu": swiglu,
     "swiglu_linear": swiglu_linear,
     "grouped_mm": grouped_mm, "moe_topk_softmax": moe_topk_softmax, "moe_permute": moe_permute,
     "moe_unpermute": moe_unpermute},
)

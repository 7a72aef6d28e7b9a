"""Attention of one block of queries against one block of keys/values, with the log-sum-exp that merges blocks.

Blockwise attention (the ring of context parallelism, parallel/ring_attention.py) computes softmax(q k^T) v one
key/value block at a time and merges the partial results with their log-sum-exp; its backward runs each block
again against the merged output and log-sum-exp (the flash-attention backward: P = exp(q k^T * scale - lse),
dS = P * (dP - rowsum(dout * out))). These two functions are that block kernel, in the [B, H, S, D] layout:

  block_attention(q, k, v, causal, mask=None)                        -> (out, lse [B, H, Sq] fp32)
  block_attention_backward(dout, q, k, v, out, lse, causal, mask=None) -> (dq, dk, dv)

mask (optional, [B, 1, Sq, Sk] bool, True where a query may attend a key: the block's part of a document mask,
ops/documents.py) restricts the block further; a query row that sees no key of the block gets out 0 and lse -inf,
so it adds nothing when blocks merge. k/v may have fewer heads than q (grouped-query attention): query head h
reads key/value head h // (Hq / Hkv), and dk/dv come back with Hkv heads.

The kernel is chosen by the device (block_kernels):
  cpu   torch's flash kernel for cpu, which returns its log-sum-exp and takes it back in its backward;
  npu   npu_fusion_attention / npu_fusion_attention_grad (BNSD): the forward returns the softmax statistics
        softmax_max and softmax_sum ([B, N, Sq, 8], the value repeated 8 times), so lse = max + log(sum); the
        backward takes the merged statistics back as softmax_max = lse, softmax_sum = 1, with the merged output as
        attention_in -- how MindSpeed's ring attention runs its blocks
        (mindspeed/core/context_parallel/ring_context_parallel/ring_context_parallel.py); causal blocks through the
        2048 compressed mask with sparse mode 2, a block's document mask as a full atten_mask (sparse mode 0);
  cuda  torch's FlashAttention kernel (_scaled_dot_product_flash_attention and its backward: fp16/bf16 on sm80+,
        no mask), else the memory-efficient kernel (_scaled_dot_product_efficient_attention: any float dtype, a
        document mask as an additive bias), both returning the log-sum-exp and taking it back;
  else  plain math with the same contract.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_npu.ops import npu as npu_ops


def _expand_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D], each key/value head repeated for its n_rep query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _fold_heads(grad: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of _expand_heads: [B, Hkv * n_rep, S, D] summed back to [B, Hkv, S, D]."""
    return grad if n_rep == 1 else grad.unflatten(1, (-1, n_rep)).sum(2)


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """True where a query may not see a key: top-left aligned, as SDPA's is_causal."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """q k^T / sqrt(D) in fp32, -inf where the causal mask or `mask` hides a key."""
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        scores.masked_fill_(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores


def math_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention in plain torch: scores and softmax in fp32, out in q's dtype."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _expand_heads(k, n_rep), _expand_heads(v, n_rep)
    scores = _masked_scores(q, k, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = lse.masked_fill(lse == float("-inf"), 0.0)  # rows that see nothing: exp(-inf) = 0, not NaN
    out = torch.matmul(torch.exp(scores - finite_lse[..., None]), v.float())
    return out.to(q.dtype), lse


def math_block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                  mask: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_attention_backward in plain torch, in fp32."""
    n_rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    q32, k32, v32 = q.float(), _expand_heads(k, n_rep).float(), _expand_heads(v, n_rep).float()
    dout32 = dout.float()
    scores = _masked_scores(q32, k32, causal, mask)
    probs = torch.exp(scores - lse[..., None])  # the block's share of the merged softmax
    dv = torch.matmul(probs.transpose(-2, -1), dout32)
    delta = (dout32 * out.float()).sum(-1, keepdim=True)  # rowsum(dout * out) of the merged output
    dscores = probs * (torch.matmul(dout32, v32.transpose(-2, -1)) - delta) * scale
    dq = torch.matmul(dscores, k32)
    dk = torch.matmul(dscores.transpose(-2, -1), q32)
    return dq.to(q.dtype), _fold_heads(dk, n_rep).to(k.dtype), _fold_heads(dv, n_rep).to(v.dtype)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one (0 / -inf, in the query's dtype) torch's flash kernel for cpu takes."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def cpu_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention on torch's flash kernel for cpu (which takes an additive mask, forward and backward)."""
    n_rep = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand_heads(k, n_rep), _expand_heads(v, n_rep), 0.0, causal, attn_mask=_additive(mask, q.dtype))
    lse = lse.float()
    if mask is not None:  # the kernel gives 0, not -inf, for a row that sees no key
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def cpu_block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                 mask: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_attention_backward on torch's flash kernel for cpu."""
    n_rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, _expand_heads(k, n_rep), _expand_heads(v, n_rep), out.to(q.dtype).contiguous(),
        lse.contiguous(), 0.0, causal, attn_mask=_additive(mask, q.dtype))
    return dq, _fold_heads(dk, n_rep), _fold_heads(dv, n_rep)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(D) [+ causal mask] [+ mask]) v of q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D], and its
    log-sum-exp [B, Hq, Sq] (fp32) per query row."""
    return block_kernels(q.device.type)[0](q, k, v, causal, mask)


def block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp of every block q attended to."""
    return block_kernels(q.device.type)[1](dout, q, k, v, out, lse, causal, mask)


def npu_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention on npu_fusion_attention (BNSD; grouped key/value heads by the kernel), lse from its softmax
    max and sum."""
    kwargs = _npu_mask(q, causal, mask)
    out, softmax_max, softmax_sum = npu_ops._torch_npu().npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "BNSD", scale=q.shape[-1] ** -0.5, keep_prob=1.0,
        **kwargs)[:3]
    lse = softmax_max[..., 0] + softmax_sum[..., 0].log()
    if mask is not None:  # rows that see no key: out 0 and lse -inf, whatever the kernel leaves there
        empty = ~mask.any(-1)
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def npu_block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                 mask: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_attention_backward on npu_fusion_attention_grad: the merged lse as softmax_max (with softmax_sum 1)
    and the merged output as attention_in."""
    softmax_max = lse.float()[..., None].expand(*lse.shape, 8).contiguous()
    dq, dk, dv = npu_ops._torch_npu().npu_fusion_attention_grad(
        q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), q.shape[1], "BNSD",
        softmax_max=softmax_max, softmax_sum=torch.ones_like(softmax_max), attention_in=out.to(q.dtype).contiguous(),
        scale_value=q.shape[-1] ** -0.5, keep_prob=1.0, **_npu_mask(q, causal, mask))[:3]
    return dq, dk, dv


def _npu_mask(q: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> dict:
    """npu_fusion_attention's mask arguments (True = masked) for a causal block and / or a block's document mask."""
    if mask is not None:
        if causal:
            mask = mask & ~_causal_mask(mask.shape[-2], mask.shape[-1], mask.device)
        return {"atten_mask": ~mask, "sparse_mode": 0}
    if causal:
        return {"atten_mask": npu_ops.causal_mask(q.device), "sparse_mode": npu_ops.SPARSE_MODE_LEFT_UP_CAUSAL}
    return {}


def cuda_uses_flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a CUDA block runs FlashAttention (fp16/bf16, head size a multiple of 8 up to 256, sm80+, no mask)
    rather than the memory-efficient kernel."""
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def cuda_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention on torch's CUDA FlashAttention or memory-efficient kernel, with its log-sum-exp."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _expand_heads(k, n_rep), _expand_heads(v, n_rep)
    if cuda_uses_flash(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _efficient_bias(mask, q), True, 0.0, causal)[:2]
    lse = lse[..., : q.shape[2]].float()  # the efficient kernel may pad the rows
    if mask is not None:  # rows that see no key: out 0 and lse -inf
        empty = ~mask.any(-1)
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def cuda_block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                  mask: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_attention_backward on the same CUDA kernel as the forward, given the merged output and lse."""
    n_rep = q.shape[1] // k.shape[1]
    ke, ve = _expand_heads(k, n_rep), _expand_heads(v, n_rep)
    out, lse, dout = out.to(q.dtype).contiguous(), lse.contiguous(), dout.contiguous()
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # the dropout seed and offset (no dropout)
    if cuda_uses_flash(q, mask):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.shape[2], ke.shape[2], 0.0, causal, unused, unused)
    else:
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, _efficient_bias(mask, q), out, lse, unused, unused, 0.0, [True, True, True, False],
            causal)
    return dq, _fold_heads(dk, n_rep), _fold_heads(dv, n_rep)


def _efficient_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A block's document mask as the memory-efficient kernel's bias: additive (0 / -inf) in q's dtype, its rows
    stored 16-element aligned and broadcast over the heads, as SDPA prepares a mask for that kernel."""
    if mask is None:
        return None
    sk = mask.shape[-1]
    bias = torch.zeros(*mask.shape[:-1], -(-sk // 16) * 16, dtype=q.dtype, device=q.device)[..., :sk]
    return bias.masked_fill_(~mask, float("-inf")).expand(q.shape[0], q.shape[1], q.shape[2], sk)


BlockKernels = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], Callable[..., tuple[torch.Tensor, ...]]]


def block_kernels(device_type: str) -> BlockKernels:
    """(forward, backward) of the block kernel for tensors on `device_type`."""
    return {"cpu": (cpu_block_attention, cpu_block_attention_backward),
            "npu": (npu_block_attention, npu_block_attention_backward),
            "cuda": (cuda_block_attention, cuda_block_attention_backward),
            }.get(device_type, (math_block_attention, math_block_attention_backward))

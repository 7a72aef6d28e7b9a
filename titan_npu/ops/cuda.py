"""CUDA kernels behind the op dispatch: SDPA restricted to the flash and memory-efficient backends.

Only attention has a CUDA-specific choice; rms_norm, rotary embedding and swiglu keep the reference (which
torch.compile fuses). The math SDPA backend is left out on purpose: falling back to it silently would turn the
fused path into the O(S^2) baseline, so an input no fused kernel takes is an error that says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_npu.ops import reference
from titan_npu.ops.dispatch import register_backend

FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def flash_supported(q: torch.Tensor) -> bool:
    """Whether FlashAttention-2 can take q: fp16/bf16, head size a multiple of 8 up to 256, an sm80+ GPU."""
    head_dim = q.shape[-1]
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """SDPA with FLASH first, then EFFICIENT; q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D]."""
    gqa = q.shape[2] != k.shape[2]
    if gqa and not flash_supported(q):
        # The memory-efficient kernel has no grouped-query support: give it one key/value head per query head.
        n_rep = q.shape[2] // k.shape[2]
        k, v = reference.repeat_kv(k, n_rep), reference.repeat_kv(v, n_rep)
        gqa = False
    with sdpa_kernel(FUSED_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=gqa
        )
    return out.transpose(1, 2)


register_backend("cuda", {"attention": attention})

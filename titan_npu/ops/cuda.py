"""CUDA kernels behind the op dispatch: SDPA on the fused backends, in an order chosen by the GPU's capability.

Attention and the MoE grouped GEMM (torch._grouped_mm on bf16 sm90+ inputs) have CUDA-specific choices; rms_norm,
rotary embedding and swiglu keep the reference (which torch.compile fuses). SDPA tries the fused kernels in a
priority order: cuDNN attention first on Hopper and later (sm90+), where it is usually the fastest, FlashAttention-2
first on Ampere and Ada (sm80/sm89), the memory-efficient kernel last (it also runs fp32 and pre-Ampere GPUs).
model.attention_backend forces one of them.
The math SDPA backend is left out on purpose: falling back to it silently would turn the fused path into the
O(S^2) baseline, so an input no allowed kernel takes is an error that says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.backends import cuda as cuda_backends
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_npu.errors import ConfigError
from titan_npu.ops import reference
from titan_npu.ops.dispatch import register_backend

if TYPE_CHECKING:
    from titan_npu.ops.documents import Documents

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", *SDPA_BACKENDS)

# SDPA's own filters, asked in priority order to name the kernel that will run (torch.backends.cuda.can_use_*).
CAN_USE: dict[str, Callable[[cuda_backends.SDPAParams], bool]] = {
    "cudnn": cuda_backends.can_use_cudnn_attention,
    "flash": cuda_backends.can_use_flash_attention,
    "efficient": cuda_backends.can_use_efficient_attention,
}

# The order SDPA tries the kernels in; set once per run by configure_attention (a global, so compiled graphs read
# it as a constant). Until then: torch's own order without the math kernel.
_priority: list[str] = ["flash", "efficient", "cudnn"]


def attention_priority(capability: tuple[int, int] | None, forced: str = "auto") -> list[str]:
    """The fused kernels SDPA may use, best first, on a GPU of this compute capability (None: not a GPU)."""
    if forced not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"model.attention_backend = {forced!r} is not one of {', '.join(ATTENTION_BACKENDS)}; pick one")
    if forced != "auto":
        return [forced]
    if capability is not None and capability >= (9, 0):
        return ["cudnn", "flash", "efficient"]
    if capability is not None and capability >= (8, 0):
        return ["flash", "cudnn", "efficient"]
    return ["efficient"]  # flash and cuDNN attention need sm80+


def configure_attention(capability: tuple[int, int] | None, forced: str = "auto") -> list[str]:
    """Fix the kernel order for this run's GPU (model.attention_backend forces one); returns it."""
    global _priority
    _priority = attention_priority(capability, forced)
    return list(_priority)


def flash_supported(q: torch.Tensor) -> bool:
    """Whether FlashAttention-2 can take q: fp16/bf16, head size a multiple of 8 up to 256, an sm80+ GPU."""
    head_dim = q.shape[-1]
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def _sdpa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in SDPA's [B, H, S, D] layout, plus whether grouped-query attention is left to the kernel.

    Only FlashAttention is relied on for grouped key/value heads; when it may not run, each query head gets its own
    key/value head.
    """
    gqa = q.shape[2] != k.shape[2]
    if gqa and not ("flash" in _priority and flash_supported(q)):
        n_rep = q.shape[2] // k.shape[2]
        k, v = reference.repeat_kv(k, n_rep), reference.repeat_kv(v, n_rep)
        gqa = False
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gqa


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              documents: Documents | None = None) -> torch.Tensor:
    """SDPA on the fused kernels in the configured priority; q [B,S,Hq,D], k/v [B,S,Hkv,D] -> [B,S,Hq,D].

    documents: SDPA with their boolean mask, on whichever kernel torch picks for a mask (FlashAttention takes none).
    """
    if documents is not None:
        return reference.attention(q, k, v, causal=causal, documents=documents)
    q, k, v, gqa = _sdpa_inputs(q, k, v)
    with sdpa_kernel([SDPA_BACKENDS[name] for name in _priority], set_priority=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)


def resolve_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> str:
    """The kernel SDPA will run for inputs like these ([B,S,H,D]): the first in priority whose checks pass."""
    q, k, v, gqa = _sdpa_inputs(q, k, v)
    params = cuda_backends.SDPAParams(q, k, v, None, 0.0, causal, gqa)
    for name in _priority:
        if CAN_USE[name](params):
            return name
    raise ConfigError(
        f"no fused attention kernel ({', '.join(_priority)}) takes {q.dtype} heads of size {q.shape[-1]} on this "
        f"device; set model.attention_backend = \"auto\", or model.use_flash_attention = false for eager attention")


def choose_attention_kernel(device: torch.device, forced: str, dtype: torch.dtype, n_heads: int, n_kv_heads: int,
                            head_dim: int, seq_len: int) -> str:
    """Set this run's kernel order from the GPU's capability (or model.attention_backend) and name the kernel the
    model's attention will run, e.g. "cudnn (order cudnn > flash > efficient)", for the start-up log."""
    order = configure_attention(torch.cuda.get_device_capability(device), forced)
    q = torch.empty(1, seq_len, n_heads, head_dim, dtype=dtype, device=device)
    kv = torch.empty(1, seq_len, n_kv_heads, head_dim, dtype=dtype, device=device)
    return f"{resolve_attention_backend(q, kv, kv)} (order {' > '.join(order)})"


# torch._grouped_mm (torch 2.13): CUTLASS grouped GEMM kernels for bf16 on sm90 and later; elsewhere it runs a slow
# per-group fallback, so those inputs take the reference instead. Every row stride (x's and the output's, the
# weight's in either layout, the gradients') must be a multiple of 16 bytes; offsets are int32 cumulative ends.
GROUPED_MM_MIN_CAPABILITY = (9, 0)
GROUPED_MM_ALIGNMENT = 16


def grouped_mm_eligible(x: torch.Tensor, w: torch.Tensor, capability: tuple[int, int] | None) -> bool:
    """Whether torch._grouped_mm's fast kernel takes x [N, K] and w [G, M, K], backward included, on a GPU of this
    compute capability (None: not a GPU): both bf16, sm90+, K and M multiples of 16 bytes, plain tensors."""
    if capability is None or tuple(capability) < GROUPED_MM_MIN_CAPABILITY:
        return False
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or any(hasattr(t, "device_mesh") for t in (x, w)):
        return False
    size = x.element_size()
    return (w.shape[-1] * size) % GROUPED_MM_ALIGNMENT == 0 and (w.shape[-2] * size) % GROUPED_MM_ALIGNMENT == 0


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
               ) -> torch.Tensor:
    """torch._grouped_mm (x [N, K] sorted by group, w [G, M, K] read as its [G, K, M] transpose, int32 offsets) where
    grouped_mm_eligible says it runs fast; the reference otherwise. Its backward is torch's (grouped GEMMs too)."""
    capability = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
    if not grouped_mm_eligible(x, w, capability):
        return reference.grouped_mm(x, w, offsets, max_group_rows)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets.to(torch.int32))


register_backend("cuda", {"attention": attention, "grouped_mm": grouped_mm})

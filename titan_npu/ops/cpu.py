"""CPU kernels behind the op dispatch: bf16 matmuls on the fp32 units of CPUs that have no bf16 instructions, and a
router softmax laid out for torch's CPU kernel.

Without AVX512-BF16 or AMX, torch's bf16 matmul on cpu is emulated and runs at a fraction of the fp32 rate (on a
Xeon with AVX-512 but no BF16: 63 GFLOP/s against 350 for a 2048^3 torch.mm, the attention backward 4x slower).
Here the bf16 operands are widened to fp32 -- exactly, every bf16 value is an fp32 value --, multiplied and
accumulated in fp32, and the result rounded to bf16 once: the arithmetic a bf16 GEMM with fp32 accumulation does,
on the fast units. Only the order of the fp32 sums can differ. Gradients follow the same rule, so a bf16 run keeps
bf16 activations and gradients (and, under autocast, fp32 weights) as on any other device.

Where the CPU has bf16 instructions, or the compute dtype is not bf16, or a tensor is a DTensor, the reference
kernels run unchanged.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titan_npu.errors import ConfigError
from titan_npu.ops import reference
from titan_npu.ops.dispatch import register_backend

if TYPE_CHECKING:
    from titan_npu.ops.documents import Documents

# "native" keeps torch's bf16 kernels, "fp32" forces the widened ones, "auto" decides from the CPU's instructions.
BF16_MATMUL_ENV = "TITAN_CPU_BF16_MATMUL"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 / AMX, Arm BF16); None when unknown.

    Reads the flags of /proc/cpuinfo (or the text given); without that file (macOS, Windows) torch's own x86 probe
    answers when it finds the instructions.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
            return True if any(getattr(torch.cpu, p, lambda: False)() for p in probes) else None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    if not flags:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@functools.lru_cache(maxsize=1)
def widen_bf16() -> bool:
    """Whether bf16 matmuls run widened to fp32: on CPUs known to lack bf16 instructions, or as TITAN_CPU_BF16_MATMUL
    says ("fp32" or "native"; "auto" is the default)."""
    choice = os.environ.get(BF16_MATMUL_ENV, "auto").strip().lower()
    if choice not in ("auto", "fp32", "native"):
        raise ConfigError(f"{BF16_MATMUL_ENV}={choice!r} is not one of auto, fp32, native; unset it or pick one")
    if choice != "auto":
        return choice == "fp32"
    return cpu_has_native_bf16() is False


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on x computes in: autocast's when it is on and x is floating point, else x's."""
    if x.is_floating_point() and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return x.dtype


def _plain(*tensors: torch.Tensor) -> bool:
    """No DTensors or other subclasses: those keep their own dispatch (sharding rules)."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


# The widened kernels are custom ops, so torch.compile keeps them whole (as external kernels) instead of tracing
# the casts and matmuls inside and handing inductor a bf16 matmul to lower.


@torch.library.custom_op("titan_npu::widened_linear", mutates_args=())
def _widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x W^T for bf16 x, W: fp32 products and sums, one rounding to bf16."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


@_widened_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("titan_npu::widened_linear_backward", mutates_args=())
def _widened_linear_backward(grad: torch.Tensor, x: torch.Tensor,
                             weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of the widened linear, each an fp32 GEMM rounded once to its input's dtype."""
    g32 = grad.float()
    grad_x = (g32 @ weight.float()).to(x.dtype)
    grad_w = (g32.flatten(0, -2).t() @ x.float().flatten(0, -2)).to(weight.dtype)
    return grad_x, grad_w


@_widened_linear_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _linear_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # bf16: the memory a bf16 matmul would keep


def _linear_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _widened_linear_backward(grad, *ctx.saved_tensors)


_widened_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T (no bias); bf16 compute runs widened to fp32 on CPUs without bf16 instructions."""
    if _compute_dtype(x) != torch.bfloat16 or not _plain(x, weight) or not widen_bf16():
        return F.linear(x, weight)
    # Autocast would round both operands to bf16 first; doing it here keeps its numerics (and its fp32 gradients
    # for fp32 weights: the casts are on the autograd tape).
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    with torch.autocast("cpu", enabled=False):
        return _widened_linear(x, weight)


@torch.library.custom_op("titan_npu::widened_attention", mutates_args=())
def _widened_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of bf16 q, k, v [B, H, S, D] on the fp32 kernel: (bf16 output, fp32 log-sum-exp); bias: an
    fp32 additive mask (0 / -inf, the kernel takes no boolean one), e.g. of documents."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.float(), k.float(), v.float(), 0.0, causal,
                                                                          attn_mask=bias)
    # The output follows q's layout; the log-sum-exp comes laid out [B, S, H]: made plain [B, H, S] (tiny) so that
    # compiled graphs see the layout the fake kernel promises.
    return out.to(q.dtype), lse.contiguous()


@_widened_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("titan_npu::widened_attention_backward", mutates_args=())
def _widened_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v from the fp32 kernel, rounded once to bf16."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, causal, attn_mask=bias)
    return tuple(g.to(q.dtype) for g in grads)


@_widened_attention_backward.register_fake
def _(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      causal: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, bias = inputs
    ctx.causal = causal
    ctx.save_for_backward(q, k, v, *output, bias)  # bf16 q, k, v, out and the fp32 log-sum-exp: what torch's kernel
    # keeps (and the mask, when there is one)


def _attention_backward(ctx, grad: torch.Tensor, _grad_lse: torch.Tensor) -> tuple:
    q, k, v, out, lse, bias = ctx.saved_tensors
    return (*_widened_attention_backward(grad, q, k, v, out, lse, ctx.causal, bias), None, None)


_widened_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              documents: Documents | None = None) -> torch.Tensor:
    """SDPA; bf16 q/k/v widened to fp32 on CPUs without bf16 instructions, the output rounded back to bf16.

    documents: torch's flash kernel for cpu with their mask (SDPA picks it for a boolean mask too; flex_attention
    would skip the masked blocks but has no backward on cpu).
    """
    if _compute_dtype(q) != torch.bfloat16 or not _plain(q, k, v) or not widen_bf16():
        return reference.attention(q, k, v, causal=causal, documents=documents)
    n_rep = q.shape[2] // k.shape[2]
    # Autocast's rounding when it is what asked for bf16; grouped key/value heads repeated for the kernel.
    q, k, v = q.to(torch.bfloat16), *(reference.repeat_kv(t.to(torch.bfloat16), n_rep) for t in (k, v))
    bias = None
    if documents is not None:
        bias = documents.cached(("bias", causal), lambda: torch.zeros(
            documents.mask(causal).shape, dtype=torch.float32, device=q.device).masked_fill_(
            ~documents.mask(causal), float("-inf")))
        causal = False
    with torch.autocast("cpu", enabled=False):
        out, _ = _widened_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, bias)
    return out.transpose(1, 2)


def moe_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.moe_topk_softmax with the softmax taken over the first dim of the transposed logits: torch's CPU
    softmax over a short last dim (a router's few experts) runs a row at a time, about 4x slower than across rows
    (fp32 results within an ulp of it; the probabilities come back as a [T, E] view of an [E, T] tensor)."""
    if not _plain(logits):
        return reference.moe_topk_softmax(logits, top_k)
    probs = torch.softmax(logits.float().t(), dim=0).t()
    return probs, torch.topk(probs, top_k, dim=-1).indices


register_backend("cpu", {"linear": linear, "attention": attention, "moe_topk_softmax": moe_topk_softmax})

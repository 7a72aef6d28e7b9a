"""Comparing an op implementation with its reference, forward and backward (shared by the kernel tests)."""

from __future__ import annotations

import torch

FP32_TOL = 1e-5  # fp32: forward and every gradient within 1e-5 (abs and rel) of the reference


def assert_same_forward_and_backward(fused, ref, inputs: list[torch.Tensor], tol: float = FP32_TOL) -> None:
    """fused(*inputs) == ref(*inputs) and so are the gradients of every input (for a random upstream gradient)."""
    outs = {}
    for name, fn in (("fused", fused), ("ref", ref)):
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator().manual_seed(1)
        upstream = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in out]
        torch.autograd.backward(out, upstream)
        outs[name] = ([o.detach() for o in out], [x.grad for x in leaves if x.requires_grad])
    (f_out, f_grad), (r_out, r_grad) = outs["fused"], outs["ref"]
    for a, b in zip(f_out, r_out, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"forward differs: {m}")
    for a, b in zip(f_grad, r_grad, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"gradient differs: {m}")


def qkv(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int = 16, kv_seq: int | None = None, seed: int = 0):
    """Random q [B,S,H,D] and k, v [B,S_kv,H_kv,D] (seeded)."""
    g = torch.Generator().manual_seed(seed)
    kv_seq = seq if kv_seq is None else kv_seq
    return (torch.randn(batch, seq, heads, head_dim, generator=g),
            torch.randn(batch, kv_seq, kv_heads, head_dim, generator=g),
            torch.randn(batch, kv_seq, kv_heads, head_dim, generator=g))

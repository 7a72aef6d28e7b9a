"""The gated delta rule (Gated DeltaNet's linear attention), chunked for training, with document resets.

Per value head, with q / k L2-normalised and q scaled by dk^-1/2, the recurrence over positions t is

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        S [dk, dv], S_0 = 0
    o_t = S_t^T q_t

(g_t <= 0 the log decay, beta_t in (0, 1) the write strength). chunk_gated_delta_rule computes it in chunks of
`chunk_size` positions as transformers' torch_chunk_gated_delta_rule (and flash-linear-attention's kernels) do: inside
a chunk the writes are condensed by a unit-lower-triangular solve (the UT transform) into matmuls, across chunks the
state is carried in a loop; everything in fp32, the output in the input's dtype.

Packed documents (ops/documents.py: a document index per position) restart the recurrence: the state a document reads
at its first position is zero, exactly as if g were -inf there. Inside a chunk this is a mask on the pairwise decays
(positions of different documents do not interact) and on the reads / writes of the state carried between chunks.

gated_delta_rule is the entry the model calls: flash-linear-attention's chunked kernel (fla.ops.gated_delta_rule:
chunk_gated_delta_rule, Triton) on a bf16 / fp16 CUDA tensor where the package is installed (documents as its
cu_seqlens), the reference above everywhere else (CPU, NPU, fp32).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # transformers' and flash-linear-attention's chunk


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (flash-linear-attention's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, segments: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """o [B, S, Hv, dv] of q, k [B, S, Hk, dk] (each q/k head serves Hv / Hk consecutive value heads), v [B, S, Hv, dv],
    log decay g and write strength beta [B, S, Hv]; segments [B, S] (a document index per position, or None for one
    document per row) restarts the state at every change of index."""
    dtype = v.dtype
    batch, seqlen, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, beta, g))  # [B, H, S, ...]
    q = l2_normalise(q) * dk**-0.5
    k = l2_normalise(k)
    pad = (-seqlen) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (seqlen + pad) // chunk_size
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(batch, hv, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(batch, hv, n, chunk_size).cumsum(-1)  # log decay from the chunk's start, inclusive
    hidden = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)  # later positions
    reads = writes = keeps = None
    if segments is not None:
        seg = F.pad(segments, (0, pad), value=-1).reshape(batch, 1, n, chunk_size)
        before = torch.cat((seg[:, :, :1, :1], seg[:, :, :-1, -1:]), dim=2)  # the document the carried state is of
        hidden = hidden | (seg[..., :, None] != seg[..., None, :])
        reads = seg == before  # positions that read the state carried into their chunk
        writes = seg == seg[..., -1:]  # positions whose writes reach the chunk's end
        keeps = before[..., 0] == seg[..., -1]  # chunks that pass the carried state on
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(hidden, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    read_decay, write_decay = decay.exp(), (decay[..., -1:] - decay).exp()
    chunk_decay = decay[..., -1].exp()
    if segments is not None:
        read_decay, write_decay = read_decay * reads, write_decay * writes
        chunk_decay = chunk_decay * keeps
    # (I + strictly-lower ut)^-1 applied to the writes: what each position writes once the chunk's earlier writes
    # are accounted for (u), and how much of the carried state it overwrites (w).
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * read_decay[..., None], upper=False, unitriangular=True)
    q_read = q * read_decay[..., None]
    k_write = k * write_decay[..., None]
    state = q.new_zeros(batch, hv, dk, dv)
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q_read[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(batch, hv, -1, dv)[:, :, :seqlen]
    return o.transpose(1, 2).to(dtype).contiguous()


@functools.cache
def _fla_chunk() -> Any:
    """flash-linear-attention's chunk_gated_delta_rule, or None where the package is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    return fla_chunk


def fla_available(x: torch.Tensor) -> bool:
    """Whether gated_delta_rule runs flash-linear-attention's kernel for tensors like x: CUDA, bf16 or fp16 (its
    kernels refuse fp32), the package installed."""
    return x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and _fla_chunk() is not None


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     *, segments: torch.Tensor | None = None, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """chunk_gated_delta_rule's output: flash-linear-attention's kernel on CUDA where installed (the batch flattened
    into one row of varlen documents, cu_seqlens the documents' host ends, or each row one document), the reference
    elsewhere."""
    if not fla_available(q):
        return chunk_gated_delta_rule(q, k, v, g, beta, segments=segments)
    batch, seqlen = q.shape[:2]
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    ends = cu_seqlens if cu_seqlens is not None else [(row + 1) * seqlen for row in range(batch)]
    offsets = torch.tensor([0, *ends], dtype=torch.long).to(q.device, non_blocking=True)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(1, batch * seqlen, *x.shape[2:])

    o, _ = _fla_chunk()(flat(q), flat(k), flat(v), g=flat(g).float(), beta=flat(beta), scale=q.shape[-1] ** -0.5,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    return o.reshape(batch, seqlen, *o.shape[2:])

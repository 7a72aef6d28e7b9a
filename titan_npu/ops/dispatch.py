"""One dispatch point per op: the implementation is chosen per device type and per op, once, then looked up per call.

Backends are plain dicts {op_name: function}. "reference" (plain torch) always exists and fills every op a
backend leaves out. In "auto" mode a tensor on device type T uses the backend registered under the name T
("npu", "cuda", ...), so titan_npu/ops/npu.py and titan_npu/ops/cuda.py plug in by calling register_backend at
import; they are imported once, on the first lookup, and must import cleanly where their vendor stack is absent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from titan_npu.errors import ConfigError
from titan_npu.ops import reference

if TYPE_CHECKING:
    from titan_npu.ops.documents import Documents

OP_NAMES: tuple[str, ...] = ("attention", "rms_norm", "apply_rotary_emb", "swiglu", "linear", "swiglu_linear",
                             "grouped_mm", "moe_topk_softmax", "moe_permute", "moe_unpermute", "indexer_topk",
                             "sparse_attention", "indexer_warmup_loss")


def _composed_swiglu_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """swiglu(linear(x, w_gate), linear(x, w_up)) through the kernels chosen for x's device."""
    return swiglu(linear(x, w_gate), linear(x, w_up))


REFERENCE: dict[str, Callable] = {
    "attention": reference.attention,
    "rms_norm": reference.rms_norm,
    "apply_rotary_emb": reference.apply_rotary_emb,
    "swiglu": reference.swiglu,
    "linear": reference.linear,
    "swiglu_linear": _composed_swiglu_linear,
    "grouped_mm": reference.grouped_mm,
    "moe_topk_softmax": reference.moe_topk_softmax,
    "moe_permute": reference.moe_permute,
    "moe_unpermute": reference.moe_unpermute,
    "indexer_topk": reference.indexer_topk,
    "sparse_attention": reference.sparse_attention,
    "indexer_warmup_loss": reference.indexer_warmup_loss,
}

# Modules that register a vendor backend when imported; a module that does not exist (yet) is skipped.
BUILTIN_BACKEND_MODULES: tuple[str, ...] = ("titan_npu.ops.npu", "titan_npu.ops.cuda", "titan_npu.ops.cpu")

_backends: dict[str, dict[str, Callable]] = {"reference": dict(REFERENCE)}
_mode: str = "auto"
_per_op: dict[str, str] = {}
# device type -> op -> (backend name, function); rebuilt lazily whenever the choice or the registry changes.
_tables: dict[str, dict[str, tuple[str, Callable]]] = {}
_builtins_loaded = False


def register_backend(name: str, impls: dict[str, Callable]) -> None:
    """Register (or replace) backend `name` providing some ops; ops it leaves out fall back to the reference."""
    if name in ("auto", "reference"):
        raise ValueError(f"backend name '{name}' is reserved; register the backend under another name")
    unknown = sorted(set(impls) - set(OP_NAMES))
    if unknown:
        raise ValueError(f"backend '{name}' provides unknown ops {unknown}; valid op names are {list(OP_NAMES)}")
    not_callable = sorted(op for op, fn in impls.items() if not callable(fn))
    if not_callable:
        raise ValueError(f"backend '{name}': implementations of {not_callable} are not callable")
    _backends[name] = dict(impls)
    _tables.clear()


def set_kernels(name: str = "auto", **per_op: str) -> None:
    """Choose kernels: "auto" (by the tensor's device type), "reference", or a registered backend; per-op overrides.

    Example: set_kernels("auto", attention="reference") keeps every fused kernel except attention.
    """
    _load_builtin_backends()
    _check_backend_name(name, "ops.set_kernels")
    for op, backend in per_op.items():
        if op not in OP_NAMES:
            raise ConfigError(f"ops.set_kernels: unknown op '{op}' (valid: {', '.join(OP_NAMES)})")
        _check_backend_name(backend, f"ops.set_kernels({op}=...)")
        if backend not in ("auto", "reference") and op not in _backends[backend]:
            provided = ", ".join(sorted(_backends[backend])) or "nothing"
            raise ConfigError(
                f"ops.set_kernels: backend '{backend}' has no '{op}' kernel (it provides {provided}); "
                f"choose 'reference' or 'auto' for {op}"
            )
    global _mode
    _mode = name
    _per_op.clear()
    _per_op.update(per_op)
    _tables.clear()


def current_kernels(device_type: str) -> dict[str, str]:
    """The backend each op uses for tensors of `device_type` ("cpu", "cuda", "npu", ...), e.g. for the run log."""
    return {op: backend for op, (backend, _) in _table(device_type).items()}


def available_backends() -> list[str]:
    """Names accepted by set_kernels: "auto", "reference" and every registered backend."""
    _load_builtin_backends()
    return ["auto", *sorted(_backends)]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, use_flash: bool = True,
    documents: Documents | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
) -> torch.Tensor:
    """Multi-head attention, q [B,S,Hq,D], k/v [B,S,Hkv,D] (Hq a multiple of Hkv) -> [B,S,Hq,D].

    use_flash=True runs the chosen fused kernel; use_flash=False always runs the eager O(S^2) baseline.
    documents (ops/documents.py): each query attends within its own document only (packed windows).
    sinks [Hq] (a learned extra softmax logit per head) or a sliding `window` (gpt-oss): reference.sink_attention
    on every device, the plain torch path, since no fused kernel registered here takes a sink.
    """
    if sinks is not None or window is not None:
        return reference.sink_attention(q, k, v, causal=causal, sinks=sinks, window=window, documents=documents)
    if not use_flash:
        return reference.eager_attention(q, k, v, causal=causal, documents=documents)
    if documents is None:
        return _table(q.device.type)["attention"][1](q, k, v, causal=causal)
    return _table(q.device.type)["attention"][1](q, k, v, causal=causal, documents=documents)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: fp32 compute, result in x.dtype."""
    return _table(x.device.type)["rms_norm"][1](x, weight, eps)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q/k [B,S,H,D] with cos/sin [S, D/2] (Meta's interleaved pairs); returns (xq, xk)."""
    return _table(xq.device.type)["apply_rotary_emb"][1](xq, xk, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return _table(gate.device.type)["swiglu"][1](gate, up)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T, the projection every Linear of the model runs."""
    return _table(x.device.type)["linear"][1](x, weight)


def swiglu_linear(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ w_gate^T) * (x @ w_up^T): the SwiGLU MLP's two input projections and its gating in one op."""
    return _table(x.device.type)["swiglu_linear"][1](x, w_gate, w_up)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
               ) -> torch.Tensor:
    """Per group g of w [G, M, K], the rows offsets[g-1]:offsets[g] of x [N, K] (sorted by group; offsets the
    int32 cumulative ends) times w[g]^T -> [N, M]: the routed experts' projections. max_group_rows bounds the rows
    of one group (for kernels that pad)."""
    return _table(x.device.type)["grouped_mm"][1](x, w, offsets, max_group_rows)


def moe_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax of the router logits [T, E] in fp32, with its gradient; the top_k experts [T, top_k] int64)."""
    return _table(logits.device.type)["moe_topk_softmax"][1](logits, top_k)


def moe_permute(x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed [T * k, D], order [T * k] int64): x [T, D]'s copies sorted stably by their expert in experts [T, k];
    routed[i] = x[order[i] // k]."""
    return _table(x.device.type)["moe_permute"][1](x, experts)


def moe_unpermute(routed: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Back to token order, each token's k copies weighted by weights [T, k] and summed -> [T, D]."""
    return _table(routed.device.type)["moe_unpermute"][1](routed, order, weights)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int,
                 documents: Documents | None = None) -> torch.Tensor:
    """DeepSeek Sparse Attention's lightning indexer: for q [B, S, H, D], one key head k [B, S, D] and weights
    [B, S, H] (fp32), each query's topk keys by sum_h weights ReLU(D^-0.5 q_h . k) among those it sees (causal,
    within its document) -> int32 [B, S, topk], best first, -1 where it sees fewer. No gradient."""
    return _table(q.device.type)["indexer_topk"][1](q, k, weights, topk, documents)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, *,
                     use_flash: bool = True) -> torch.Tensor:
    """Attention of q [B, S, H, D] over the keys indices (int32 [B, S, topk] from indexer_topk, shared by the heads)
    selects in k [B, S, H, D] / v [B, S, H, Dv] -> [B, S, H, Dv], scale D^-0.5. use_flash=False always runs the
    eager reference."""
    if not use_flash:
        return reference.sparse_attention(q, k, v, indices, use_flash=False)
    return _table(q.device.type)["sparse_attention"][1](q, k, v, indices)


def indexer_warmup_loss(q: torch.Tensor, k: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                        weights: torch.Tensor, rope_dim: int, documents: Documents | None = None) -> torch.Tensor:
    """DeepSeek Sparse Attention's dense warm-up loss: the mean over the queries of KL(p || softmax(I)) over the
    keys each sees, p the main attention's (q, k [B, S, H, D], its last rope_dim channels RoPE) probabilities summed
    over the heads and L1-normalised (no gradient), I the indexer's scores of q_index [B, S, H_I, D_I], k_index
    [B, S, D_I], weights [B, S, H_I] fp32 (indexer_topk's operands), the gradient flowing to those three."""
    return _table(q.device.type)["indexer_warmup_loss"][1](q, k, q_index, k_index, weights, rope_dim, documents)


def _table(device_type: str) -> dict[str, tuple[str, Callable]]:
    table = _tables.get(device_type)
    if table is None:
        table = _build_table(device_type)
    return table


def _build_table(device_type: str) -> dict[str, tuple[str, Callable]]:
    _load_builtin_backends()
    table = {}
    for op in OP_NAMES:
        choice = _per_op.get(op, _mode)
        backend = device_type if choice == "auto" else choice
        impl = _backends.get(backend, {}).get(op)
        table[op] = (backend, impl) if impl is not None else ("reference", REFERENCE[op])
    _tables[device_type] = table
    return table


def _check_backend_name(name: str, where: str) -> None:
    if name != "auto" and name not in _backends:
        raise ConfigError(f"{where}: unknown kernels '{name}' (valid: {', '.join(available_backends())})")


def _load_builtin_backends() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN_BACKEND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            # Only "this backend is not part of the install" is skipped; a backend that fails to import is a bug.
            if e.name != module:
                raise

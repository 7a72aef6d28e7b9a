"""A stand-in for torch_npu that runs on the CPU, for tests on machines without an Ascend NPU.

Its ops are defined with the schemas of the pinned torch_npu wheel (npu_wheel.py, fetched once and cached): a call
with an argument name, type or default the real op does not have fails in the dispatcher exactly as it would on a
card, and every result is checked against the wheel's meta function (arity, shapes, dtypes). The CPU kernels
follow the API reference -- input layouts, mask convention (True = masked out), sparse modes, scale, dtype rules,
shape limits -- in plain torch, so autograd gives the backward, and reject what the real kernel rejects.

Importing it does what the real package does to torch: it attaches the `torch.npu` device namespace. Installed with
the wheel's dist-info (npu_wheel.Wheel.write_dist_info), `import torch` imports it through the wheel's
torch.backends entry point, as it imports the real package. Which
kernels ran is counted in `calls` so tests can prove that the NPU path was taken. Two switches serve tests that
run a whole program in a subprocess: FAKE_NPU_TENSORS=1 makes "npu" a real torch device (tensors backed by CPU
memory, see _device.py) and FAKE_TORCH_NPU_REPORT=<file> writes the calls, the environment seen at import, at
device binding and at each HCCL group's creation, the HCCL timeouts and the device requests to <file> at exit
(with FAKE_NPU_TENSORS=1, "hccl" is a process-group backend for the fake device, _hccl.py).
"""

from __future__ import annotations

import collections
import os
import sys

import npu_wheel
import torch
import torch.nn.functional as F

# The environment as the real package reads it: the allocator, task queue and runtime settings at import.
_ENV_PREFIXES = ("HCCL_", "PYTORCH_NPU_", "PYTORCH_ALLOC_CONF", "GLOO_SOCKET", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF",
                 "STREAMS_PER_DEVICE", "TORCH_HCCL_", "CLOSE_MATMUL_K_SHIFT", "ASCEND_")
events: list[tuple[str, dict[str, str]]] = []  # (what happened, the relevant environment at that moment)


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


def _record_event(what: str) -> None:
    """Remember that `what` happened (import, set_device, hccl_init) and the environment the runtime saw then,
    with torch's deterministic-algorithms switch."""
    env = _environment()
    env["deterministic_algorithms"] = str(torch.are_deterministic_algorithms_enabled())
    events.append((what, env))


_record_event("import")


def _autoload() -> None:
    """The wheel's torch.backends entry point (its entry_points.txt: `torch_npu = torch_npu:_autoload`), which
    `import torch` calls once it has imported this package (torch_npu/__init__.py:67-71: "an entrypoint called by
    PyTorch when running 'import torch'"). Recorded, so that a test sees torch import the package."""
    _record_event("autoload")


from torch_npu import npu, optim, profiler  # noqa: E402, F401  (submodules, as in the real package)

# The real package is versioned "<torch X.Y.Z>[.postN]"; FAKE_TORCH_NPU_VERSION lets a test pretend otherwise.
__version__ = os.environ.get("FAKE_TORCH_NPU_VERSION") or npu_wheel.TORCH_NPU_VERSION

calls: collections.Counter = collections.Counter()


def _write_report(path: str) -> None:
    """What the process asked of torch_npu, for a test that ran it in a subprocess."""
    import json

    report = {"calls": dict(calls), "env": _environment(), "events": events,
              "set_device_calls": npu.state["set_device_calls"], "memory_fraction": npu.state["memory_fraction"],
              "empty_cache_calls": npu.state["empty_cache_calls"],
              "deterministic": torch.are_deterministic_algorithms_enabled(),
              "hccl_timeouts": sys.modules["torch_npu._hccl"].timeouts if "torch_npu._hccl" in sys.modules else []}
    with open(path, "w") as f:
        json.dump(report, f)


if os.environ.get("FAKE_TORCH_NPU_REPORT"):
    import atexit

    # "{rank}" in the path: one report per rank of a torchrun job
    atexit.register(_write_report, os.environ["FAKE_TORCH_NPU_REPORT"].replace("{rank}", os.environ.get("RANK", "0")))

if os.environ.get("FAKE_NPU_TENSORS") == "1":
    from torch_npu import _device, _hccl

    _device.install(npu)  # registers torch.npu, as the real package does
    _hccl.install()
else:
    torch.npu = npu

# The compressed causal mask of sparse modes 2/3 is always this size, whatever the sequence length.
_COMPRESSED_MASK_SIZE = 2048
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")


def _to_bnsd(x: torch.Tensor, layout: str, head_num: int | None, head_dim: int) -> torch.Tensor:
    """Bring one of q/k/v from the caller's layout to [B, N, S, D]; head_num None = infer from the hidden size."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, h // head_dim, head_dim).transpose(1, 2)
    s, b, h = x.shape  # SBH
    return x.view(s, b, h // head_dim, head_dim).permute(1, 2, 0, 3)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.transpose(1, 2).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _expand_compressed_mask(mask: torch.Tensor, sq: int, skv: int, offset: int) -> torch.Tensor:
    """The full [Sq, Skv] mask that a compressed 2048x2048 causal mask stands for.

    The kernel reads the compressed mask along diagonals: element (i, j) takes the value the compressed mask has
    at the same distance j - i - offset from its main diagonal; distances beyond 2048 are fully masked (above) or
    fully visible (below). offset is 0 for the top-left causal mode and Skv - Sq for the bottom-right one.
    """
    n = _COMPRESSED_MASK_SIZE
    lowest = -(sq - 1) - offset
    dists = torch.arange(lowest, skv - offset)  # every distance j - i - offset that occurs
    clipped = dists.clamp(-(n - 1), n - 1)
    per_dist = torch.where(clipped >= 0, mask[0, clipped.clamp(min=0)], mask[(-clipped).clamp(min=0), 0])
    per_dist = (per_dist | (dists >= n)) & (dists > -n)
    index = torch.arange(skv).unsqueeze(0) - torch.arange(sq).unsqueeze(1) - offset - lowest
    return per_dist[index]


def _npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """softmax(mask(scale * Q K^T)) V; returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels), attention_out in the input layout. TND: query [T, N1, D], key/value [T, N2, D] hold sequences one after
    the other, actual_seq_qlen / actual_seq_kvlen their cumulative ends; each attends within itself (the mask and
    sparse mode apply per sequence); softmax_max / softmax_sum are [T, N1, 8]."""
    calls["npu_fusion_attention"] += 1
    args = (pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens, next_tockens, inner_precise, prefix)
    rest = (sparse_mode, gen_mask_parallel, sync, softmax_layout, sink, dropout_mask, seed, offset)
    if input_layout != "TND":
        return _fusion_attention_dense(query, key, value, head_num, input_layout, *args, actual_seq_qlen,
                                       actual_seq_kvlen, *rest)
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise RuntimeError("npu_fusion_attention: layout TND needs actual_seq_qlen and actual_seq_kvlen")
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise RuntimeError("npu_fusion_attention: layout TND needs 3-D query/key/value")
    if len(actual_seq_qlen) != len(actual_seq_kvlen):
        raise RuntimeError("npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen differ in length")
    for ends, t in ((actual_seq_qlen, query.shape[0]), (actual_seq_kvlen, key.shape[0])):
        if not ends or ends[-1] != t or any(b <= a for a, b in zip([0, *ends], ends)):
            raise RuntimeError(f"npu_fusion_attention: cumulative lengths {list(ends)} must rise to T={t}")
    outs, maxes, sums = [], [], []
    for q0, q1, k0, k1 in zip([0, *actual_seq_qlen], actual_seq_qlen, [0, *actual_seq_kvlen], actual_seq_kvlen):
        out, row_max, row_sum, *_ = _fusion_attention_dense(
            query[None, q0:q1], key[None, k0:k1], value[None, k0:k1], head_num, "BSND", *args, None, None, *rest)
        outs.append(out[0])
        maxes.append(row_max[0].transpose(0, 1))
        sums.append(row_sum[0].transpose(0, 1))
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return torch.cat(outs), torch.cat(maxes), torch.cat(sums), softmax_out, 0, 0, 0


def _positions_masked(atten_mask: torch.Tensor | None, sparse_mode: int, sq: int, skv: int, pre_tockens: int,
                      next_tockens: int, device: torch.device) -> torch.Tensor | None:
    """The [.., Sq, Skv] bool mask (True = masked) that atten_mask and the sparse mode stand for, or None."""
    masked = None
    if sparse_mode in (2, 3):
        if atten_mask is None or tuple(atten_mask.shape) != (_COMPRESSED_MASK_SIZE,) * 2:
            raise RuntimeError(
                f"npu_fusion_attention: sparse_mode={sparse_mode} needs the compressed {_COMPRESSED_MASK_SIZE}x"
                f"{_COMPRESSED_MASK_SIZE} atten_mask"
            )
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError("npu_fusion_attention: atten_mask must be bool or uint8")
        offset = 0 if sparse_mode == 2 else skv - sq
        masked = _expand_compressed_mask(atten_mask.bool().cpu(), sq, skv, offset).to(device)
    elif sparse_mode in (0, 1):
        if atten_mask is not None:
            if atten_mask.dtype not in (torch.bool, torch.uint8):
                raise RuntimeError("npu_fusion_attention: atten_mask must be bool or uint8")
            if tuple(atten_mask.shape[-2:]) != (sq, skv):
                raise RuntimeError(
                    f"npu_fusion_attention: sparse_mode={sparse_mode} needs an atten_mask of [..., {sq}, {skv}], "
                    f"got {list(atten_mask.shape)}"
                )
            masked = atten_mask.bool()
            if sparse_mode == 0:
                # defaultMask: positions outside the band [i - pre_tockens, i + next_tockens] are masked too.
                dist = torch.arange(skv).unsqueeze(0) - torch.arange(sq).unsqueeze(1)
                band = (dist > next_tockens) | (-dist > pre_tockens)
                masked = masked | band.to(masked.device)
    else:
        raise NotImplementedError(f"fake npu_fusion_attention: sparse_mode={sparse_mode} is not modelled")

    return masked


def _npu_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dpse, dsink) of npu_fusion_attention from the forward's softmax statistics: the probabilities
    are recomputed as exp(scale * Q K^T - softmax_max) / softmax_sum under the same mask, and attention_in (the
    forward's output) gives rowsum(dy * out). dk/dv come back with the key/value heads, in the input layout."""
    calls["npu_fusion_attention_grad"] += 1
    if input_layout not in _LAYOUTS:
        raise RuntimeError(f"npu_fusion_attention_grad: input_layout {input_layout!r} is not one of {_LAYOUTS}")
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise RuntimeError("npu_fusion_attention_grad: needs softmax_max, softmax_sum and attention_in")
    if (pse is not None or padding_mask is not None or prefix is not None or actual_seq_qlen is not None
            or sink is not None or softmax_layout or keep_prob != 1.0):
        raise NotImplementedError("fake npu_fusion_attention_grad: pse / padding_mask / prefix / varlen / sink / "
                                  "softmax_layout / dropout are not modelled")
    head_dim = query.shape[-1] if input_layout in ("BSND", "BNSD") else query.shape[-1] // head_num
    q, k, v, do, out = (_to_bnsd(t, input_layout, head_num if t is not key and t is not value else None,
                                 head_dim).float() for t in (query, key, value, dy, attention_in))
    b, n1, sq, _ = q.shape
    n2, skv = k.shape[1], k.shape[2]
    if tuple(softmax_max.shape) != (b, n1, sq, 8) or softmax_sum.shape != softmax_max.shape:
        raise RuntimeError(f"npu_fusion_attention_grad: softmax_max/sum must be [{b}, {n1}, {sq}, 8]")
    group = n1 // n2
    scores = torch.matmul(q, k.repeat_interleave(group, dim=1).transpose(-2, -1)) * scale_value
    masked = _positions_masked(atten_mask, sparse_mode, sq, skv, pre_tockens, next_tockens, scores.device)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.exp(scores - softmax_max[..., :1].float()) / softmax_sum[..., :1].float()
    dv = torch.matmul(probs.transpose(-2, -1), do)
    dscores = probs * (torch.matmul(do, v.repeat_interleave(group, dim=1).transpose(-2, -1))
                       - (do * out).sum(-1, keepdim=True)) * scale_value
    dq = torch.matmul(dscores, k.repeat_interleave(group, dim=1))
    dk = torch.matmul(dscores.transpose(-2, -1), q)
    dk, dv = (t.unflatten(1, (n2, group)).sum(2) for t in (dk, dv))
    grads = tuple(_from_bnsd(t, input_layout).to(query.dtype) for t in (dq, dk, dv))
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return (*grads, empty, torch.empty(0, device=query.device))


def _fusion_attention_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """npu_fusion_attention in the layouts with whole sequences (BSH, SBH, BSND, BNSD)."""
    if input_layout not in _LAYOUTS:
        raise RuntimeError(f"npu_fusion_attention: input_layout {input_layout!r} is not one of {_LAYOUTS}")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float16, torch.bfloat16,
                                                                            torch.float32):
        raise RuntimeError("npu_fusion_attention: query, key and value must share one of fp16, bf16, fp32")
    if (pse is not None or padding_mask is not None or prefix is not None or actual_seq_qlen is not None
            or sink is not None or dropout_mask is not None or softmax_layout):
        raise NotImplementedError("fake npu_fusion_attention: pse / padding_mask / prefix / varlen / sink / "
                                  "dropout_mask / softmax_layout are not modelled")
    if keep_prob != 1.0:
        raise NotImplementedError("fake npu_fusion_attention: dropout (keep_prob < 1) is not modelled")
    expected_dims = 3 if input_layout in ("BSH", "SBH") else 4
    if query.dim() != expected_dims or key.dim() != expected_dims or value.dim() != expected_dims:
        raise RuntimeError(f"npu_fusion_attention: layout {input_layout} needs {expected_dims}-D query/key/value")
    if input_layout in ("BSH", "SBH"):
        if query.shape[-1] % head_num:
            raise RuntimeError("npu_fusion_attention: hidden size is not a multiple of head_num")
        head_dim = query.shape[-1] // head_num
    else:
        head_dim = query.shape[-1]
        n_axis = 2 if input_layout == "BSND" else 1
        if query.shape[n_axis] != head_num:
            raise RuntimeError(
                f"npu_fusion_attention: head_num={head_num} but query has {query.shape[n_axis]} heads in "
                f"layout {input_layout}"
            )
    q = _to_bnsd(query, input_layout, head_num, head_dim).float()
    k = _to_bnsd(key, input_layout, None, head_dim).float()
    v = _to_bnsd(value, input_layout, None, head_dim).float()
    b, n1, sq, _ = q.shape
    n2, skv = k.shape[1], k.shape[2]
    if k.shape[0] != b or v.shape != k.shape or k.shape[-1] != head_dim:
        raise RuntimeError("npu_fusion_attention: key/value shapes do not fit the query")
    if n1 % n2:
        raise RuntimeError(f"npu_fusion_attention: query heads {n1} not a multiple of key/value heads {n2}")
    # GQA: query heads [g*G, (g+1)*G) share key/value head g.
    k = k.repeat_interleave(n1 // n2, dim=1)
    v = v.repeat_interleave(n1 // n2, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, N1, Sq, Skv]

    masked = _positions_masked(atten_mask, sparse_mode, sq, skv, pre_tockens, next_tockens, scores.device)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
    with torch.no_grad():  # the softmax statistics the kernel returns for its backward: row max and sum of exp
        row_max = scores.amax(dim=-1, keepdim=True)
        row_sum = torch.exp(torch.logsumexp(scores, dim=-1, keepdim=True) - row_max)
    softmax_max = row_max.expand(b, n1, sq, 8).contiguous()
    softmax_sum = row_sum.expand(b, n1, sq, 8).contiguous()
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, softmax_out, 0, 0, 0


def _npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x * rsqrt(mean(x^2) + eps) * gamma over gamma's trailing dims, y in x's dtype, rstd in fp32.

    gamma has x's dtype, or fp32 beside fp16/bf16 activations (Atlas A2 and later take the mixed pair).
    """
    calls["npu_rms_norm"] += 1
    if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError("npu_rms_norm: input must be fp16, bf16 or fp32")
    if gamma.dtype != self.dtype and gamma.dtype != torch.float32:
        raise RuntimeError(f"npu_rms_norm: gamma dtype {gamma.dtype} must be the input's ({self.dtype}) or fp32")
    g = gamma.dim()
    if tuple(self.shape[-g:]) != tuple(gamma.shape):
        raise RuntimeError(f"npu_rms_norm: gamma shape {list(gamma.shape)} is not the input's trailing dims")
    dims = tuple(range(self.dim() - g, self.dim()))
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


def _rotate(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


# npu_rotary_mul's documented limits (jit_compile=False): D even and below 896; B * N below 1000 in interleave mode,
# B and N each below 1000 in half mode; in interleave mode r1/r2 broadcast over batch and heads (1S1D for BSND).
ROTARY_MAX_HEAD_DIM = 896
ROTARY_MAX_BN = 1000


def _npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                    rotate: torch.Tensor | None = None) -> torch.Tensor:
    """output = r1 * input + r2 * rotate(input), rotate by halves ("half") or by adjacent pairs ("interleave")."""
    calls["npu_rotary_mul"] += 1
    if rotate is not None:
        raise NotImplementedError("fake npu_rotary_mul: the rotate matrix is not modelled")
    if rotary_mode not in ("half", "interleave"):
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not 'half' or 'interleave'")
    if input.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise RuntimeError("npu_rotary_mul: input, r1 and r2 must be 4-D")
    if r1.shape != r2.shape or r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise RuntimeError("npu_rotary_mul: r1 and r2 must have one shape and the input's dtype")
    d = input.shape[-1]
    if r1.shape[-1] != d or d % 2 or d >= ROTARY_MAX_HEAD_DIM:
        raise RuntimeError(f"npu_rotary_mul: head size {d} must be even, below {ROTARY_MAX_HEAD_DIM}, and r1/r2's")
    b, n = input.shape[0], input.shape[2]
    if rotary_mode == "interleave":
        if b * n >= ROTARY_MAX_BN:
            raise RuntimeError(f"npu_rotary_mul: interleave mode needs B * N < {ROTARY_MAX_BN}, got {b} * {n}")
        if r1.shape[0] != 1 or r1.shape[2] != 1:
            raise RuntimeError(f"npu_rotary_mul: interleave mode needs r1/r2 of 1S1D, got {list(r1.shape)}")
    elif b >= ROTARY_MAX_BN or n >= ROTARY_MAX_BN:
        raise RuntimeError(f"npu_rotary_mul: half mode needs B and N below {ROTARY_MAX_BN}, got {b} and {n}")
    try:
        torch.broadcast_shapes(r1.shape, input.shape)
    except RuntimeError as e:
        raise RuntimeError(f"npu_rotary_mul: r1 shape {list(r1.shape)} does not broadcast to the input") from e
    x32 = input.float()
    return (r1.float() * x32 + r2.float() * _rotate(x32, rotary_mode)).to(input.dtype)


def _npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """swish(A) * B where A, B are the first and second halves of the input along dim."""
    calls["npu_swiglu"] += 1
    if not self.is_contiguous():
        raise RuntimeError("npu_swiglu: non-contiguous input is not supported")
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: size {self.shape[dim]} of dim {dim} is not even")
    a, b = torch.chunk(self.float(), 2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


# --- mixture-of-experts kernels -----------------------------------------------------------------------------------
# From the wheel's API reference (torch_npu/_op_plugin_docs.py) and meta registrations. Of these, torch_npu 2.13.0
# registers a backward (generated autograd nodes NpuMoeTokenPermuteBackward0 / NpuMoeTokenUnpermuteBackward0 in
# torch_npu/lib/libtorch_npu.so) for the token permutation ops only: npu_grouped_matmul and
# npu_moe_gating_top_k_softmax have none (WITHOUT_AUTOGRAD below).

GMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GMM_INNER_LIMIT = 65536  # the stored last dim of each x and weight must be below it (Atlas A2)
PERMUTE_MAX_TOPK = 512


def _inner_size(t: torch.Tensor) -> int:
    """The length of t's stored last axis: its last dim, or the one before when t is a transposed view."""
    return t.shape[-2] if t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1 else t.shape[-1]


def _npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                        antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                        activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                        group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                        weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None) -> list[torch.Tensor]:
    """The non-quantised single-tensor case: one x, one weight, a group_list tensor, one output (split_item 2/3).

    group_type 0 splits x [M, K]'s rows: y[rows of g] = x[rows of g] @ weight[g], weight [E, K, N] -> y [M, N].
    group_type 2 splits the contracted axis: x [M, K] (a transposed view of a [K, M] tensor), weight [K, N]:
    y[g] = x[:, part g of K] @ weight[part g of K, :] -> y [E, M, N] (an empty part gives zeros).
    group_list: int64, cumulative ends (group_list_type 0) or sizes (1), one per group, covering the whole axis.
    """
    calls["npu_grouped_matmul"] += 1
    quantised = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                 activation_quant_scale, activation_quant_offset, tuning_config, output_dtype, x_dtype,
                 weight_dtype, scale_dtype, per_token_scale_dtype)
    if any(a is not None for a in quantised) or act_type:
        raise NotImplementedError("fake npu_grouped_matmul: bias, quantisation, activation and tuning are not modelled")
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_list is None:
        raise NotImplementedError("fake npu_grouped_matmul: only one x, one weight, a group_list tensor and one output "
                                  "(split_item 2 or 3) are modelled")
    (a,), (b,) = x, weight
    if a.dtype not in GMM_DTYPES or b.dtype != a.dtype:
        raise RuntimeError(f"npu_grouped_matmul: x {a.dtype} and weight {b.dtype} must share one of fp16, bf16, fp32")
    if group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise RuntimeError(f"npu_grouped_matmul: group_list must be a 1-D int64 tensor, got {group_list.dtype} "
                           f"of {group_list.dim()} dims")
    if group_list_type not in (0, 1):
        raise RuntimeError(f"npu_grouped_matmul: group_list_type {group_list_type} is not 0 (cumsum) or 1 (counts)")
    for name, t in (("x", a), ("weight", b)):
        if _inner_size(t) >= GMM_INNER_LIMIT:
            raise RuntimeError(f"npu_grouped_matmul: the inner axis of {name} ({_inner_size(t)}) must be below "
                               f"{GMM_INNER_LIMIT}")
    sizes = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    if bool((sizes < 0).any()):
        raise RuntimeError("npu_grouped_matmul: group_list must be non-negative and, as cumsum, non-decreasing")
    if a.dim() != 2:
        raise RuntimeError(f"npu_grouped_matmul: x must be 2-D here, got {a.dim()} dims")
    if group_type == 0:
        if b.dim() != 3 or b.shape[0] != group_list.shape[0] or b.shape[1] != a.shape[1]:
            raise RuntimeError(f"npu_grouped_matmul: group_type 0 needs weight [E, K, N] with E = len(group_list) = "
                               f"{group_list.shape[0]} and K = x's {a.shape[1]}, got {list(b.shape)}")
        if int(sizes.sum()) != a.shape[0]:
            raise RuntimeError(f"npu_grouped_matmul: the groups cover {int(sizes.sum())} rows, x has {a.shape[0]}")
        parts = torch.split(a.float(), sizes.tolist())
        return [torch.cat([p @ b[g].float() for g, p in enumerate(parts)]).to(a.dtype)]
    if group_type == 2:
        if b.dim() != 2 or b.shape[0] != a.shape[1]:
            raise RuntimeError(f"npu_grouped_matmul: group_type 2 needs weight [K, N] with K = x's {a.shape[1]}, "
                               f"got {list(b.shape)}")
        if int(sizes.sum()) != a.shape[1]:
            raise RuntimeError(f"npu_grouped_matmul: the groups cover {int(sizes.sum())} of K, x has {a.shape[1]}")
        a_parts = torch.split(a.float(), sizes.tolist(), dim=1)
        b_parts = torch.split(b.float(), sizes.tolist(), dim=0)
        return [torch.stack([p @ q for p, q in zip(a_parts, b_parts)]).to(a.dtype)]
    raise NotImplementedError(f"fake npu_grouped_matmul: group_type {group_type} is not modelled (0: M, 2: K)")


def _npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, expert_idx, row_idx): y the k largest softmax values of each row (descending, not renormalised, in x's
    dtype), expert_idx their int32 columns, row_idx[i, j] = j * rows + i (the layout npu_moe_init_routing reads)."""
    calls["npu_moe_gating_top_k_softmax"] += 1
    if finished is not None:
        raise NotImplementedError("fake npu_moe_gating_top_k_softmax: finished is not modelled")
    if x.dtype not in GMM_DTYPES or x.dim() not in (2, 3):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: x must be 2-D or 3-D fp16/bf16/fp32, got {x.dim()}-D "
                           f"{x.dtype}")
    if not 0 < k <= min(x.shape[-1], 1024):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: k={k} must be in (0, min(experts, 1024)]")
    values, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
    rows = x.numel() // x.shape[-1]
    row_idx = (torch.arange(k, device=x.device) * rows + torch.arange(rows, device=x.device).unsqueeze(1))
    row_idx = row_idx.view(*x.shape[:-1], k)
    return values.to(x.dtype), idx.to(torch.int32), row_idx.to(torch.int32)


def _npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None,
                           padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(permuted_tokens, sorted_indices): sorted_indices int32 the stable sort of the flattened indices [T * topK],
    permuted_tokens[i] = tokens[sorted_indices[i] // topK] (bf16 only), cut to num_out_tokens rows."""
    calls["npu_moe_token_permute"] += 1
    if padded_mode:
        raise RuntimeError("npu_moe_token_permute: padded_mode=True is not supported")
    if tokens.dtype != torch.bfloat16 or tokens.dim() != 2:
        raise RuntimeError(f"npu_moe_token_permute: tokens must be 2-D bf16, got {tokens.dim()}-D {tokens.dtype}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() not in (1, 2):
        raise RuntimeError(f"npu_moe_token_permute: indices must be 1-D or 2-D int64, got {indices.dtype}")
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    if topk > PERMUTE_MAX_TOPK or indices.shape[0] != tokens.shape[0]:
        raise RuntimeError(f"npu_moe_token_permute: indices {list(indices.shape)} must be [tokens, topK <= "
                           f"{PERMUTE_MAX_TOPK}] for {tokens.shape[0]} tokens")
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True)
    n = indices.numel()
    keep = n if not num_out_tokens else (min(num_out_tokens, n) if num_out_tokens > 0 else n + num_out_tokens)
    return tokens[sorted_indices[:keep] // topk], sorted_indices.to(torch.int32)


def _npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                             probs: torch.Tensor | None = None, padded_mode: bool = False,
                             restore_shape: list[int] | None = None) -> torch.Tensor:
    """out[t] = sum_j probs[t, j] * permuted_tokens[i] over the i with sorted_indices[i] = t * topK + j (topK =
    probs' second dim, or 1); bf16 in and out, the sum in fp32."""
    calls["npu_moe_token_unpermute"] += 1
    if padded_mode:
        raise RuntimeError("npu_moe_token_unpermute: padded_mode=True is not supported")
    if permuted_tokens.dtype != torch.bfloat16 or (probs is not None and probs.dtype != torch.bfloat16):
        raise RuntimeError(f"npu_moe_token_unpermute: permuted_tokens and probs must be bf16, got "
                           f"{permuted_tokens.dtype} and {None if probs is None else probs.dtype}")
    if sorted_indices.dim() != 1 or sorted_indices.shape[0] != permuted_tokens.shape[0]:
        raise RuntimeError("npu_moe_token_unpermute: sorted_indices must be 1-D, one per permuted token")
    topk = 1 if probs is None else probs.shape[1]
    rows = permuted_tokens.float().new_zeros(sorted_indices.shape[0], permuted_tokens.shape[1])
    rows = rows.index_copy(0, sorted_indices.long(), permuted_tokens.float()).view(-1, topk, permuted_tokens.shape[1])
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


def _get_npu_format(self: torch.Tensor) -> int:
    """The storage format of a tensor: ND (2) for every tensor the fake makes."""
    return 2


# The torch_npu ops the project calls, each with its CPU kernel. Adding one is a line here (and its kernel).
KERNELS = {
    "get_npu_format": _get_npu_format,  # the fused optimizers of torch_npu.optim call it
    "npu_fusion_attention": _npu_fusion_attention,
    "npu_fusion_attention_grad": _npu_fusion_attention_grad,
    "npu_rms_norm": _npu_rms_norm,
    "npu_rotary_mul": _npu_rotary_mul,
    "npu_swiglu": _npu_swiglu,
    "npu_grouped_matmul": _npu_grouped_matmul,
    "npu_moe_gating_top_k_softmax": _npu_moe_gating_top_k_softmax,
    "npu_moe_token_permute": _npu_moe_token_permute,
    "npu_moe_token_unpermute": _npu_moe_token_unpermute,
}
# The ops torch_npu registers no backward for: their outputs carry no gradient on a card, nor here.
WITHOUT_AUTOGRAD = ("npu_grouped_matmul", "npu_moe_gating_top_k_softmax")
# Ops defined from the wheel without a kernel yet: the other MoE routing and grouped-matmul ops.
SCHEMA_ONLY = (
    "npu_grouped_matmul_add_", "npu_moe_init_routing_v2", "npu_moe_gating_top_k", "npu_moe_compute_expert_tokens",
    "npu_moe_finalize_routing", "npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map",
    "npu_moe_re_routing",
)
npu_wheel.define_ops([*KERNELS, *SCHEMA_ONLY], KERNELS, without_autograd=WITHOUT_AUTOGRAD)
globals().update({name: getattr(torch.ops.npu, name) for name in (*KERNELS, *SCHEMA_ONLY)})  # torch_npu.<op>

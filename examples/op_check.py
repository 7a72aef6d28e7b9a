"""Check every fused kernel on this machine's device against the plain-torch reference, forward and backward.

On Ascend these are the torch_npu kernels the project calls: npu_fusion_attention (also in TND layout within
packed documents, 1,025 of them cut into calls of at most 1,024, and with npu_fusion_attention_grad as ring
attention's block kernel), npu_rms_norm (also with an fp32 weight beside bf16 activations, as mixed precision runs
it: cast to their dtype for the kernel), npu_rotary_mul, npu_swiglu (also fed by one projection over the
concatenated w1/w3), and the _fused_adamw_ kernel behind torch's fused AdamW (a few optimizer steps against torch's
for-loop AdamW). For mixture of experts: npu_grouped_matmul (forward and the input's gradient, row groups, empty
groups included, 1,025 groups cut into calls of at most 1,024) with npu_grouped_matmul_add_ (the weight's gradient,
contracted-axis groups) against a per-expert loop, fp16/bf16 only (fp32 takes the reference);
npu_moe_gating_top_k_softmax (the router's top-k); npu_moe_token_permute / npu_moe_token_unpermute (bf16 only; fp32
takes the reference), also as the MoE layer chains them -- the permutation's order from moe_permute fed to
moe_unpermute, which proves the index convention the two kernels share on the card. For DeepSeek Sparse Attention:
npu_lightning_indexer (the keys it selects, weighed by the reference's scores, at a small and the published shape:
64 heads of 128, top-2048 of 4,096) and npu_sparse_flash_attention with npu_sparse_flash_attention_grad (MLA's
192-wide per-head keys over the selected keys), npu_dense_lightning_indexer_softmax_lse with
npu_dense_lightning_indexer_grad_kl_loss (the dense warm-up's KL loss and the indexer's gradients), fp16/bf16 only
(fp32 takes the reference).

    python examples/op_check.py            # the device titan-npu would train on (npu > cuda > cpu, or TITAN_DEVICE)
    python examples/op_check.py --quick    # small shapes only
    python examples/op_check.py --bench    # also time fused vs eager attention at Llama-7B head shapes

Each line compares the kernel the op dispatch picks for the device (torch_npu on Ascend, SDPA flash on CUDA) with
the reference computed in fp32 on the same device from the same inputs, and prints PASS or FAIL with the largest
error relative to the reference's largest magnitude. The exit status is 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from titan_npu.device import setup_device, synchronize
from titan_npu.ops import attention_blocks, current_kernels, dispatch, reference
from titan_npu.ops.documents import Documents

# Largest error / largest reference magnitude allowed: accumulation order differs between kernels, so long
# reductions (attention) get more room than elementwise ops; bf16 keeps about 3 significant digits.
# The optimizer check compares parameters after ADAMW_STEPS steps (fp32 and bf16 parameters).
TOLERANCE = {
    torch.float32: {"attention": 1e-4, "attention_block": 1e-4,
                    "rms_norm": 1e-5, "apply_rotary_emb": 1e-5, "swiglu": 1e-5, "adamw": 1e-5,
                    "swiglu_linear": 1e-4,  # a reduction over D: matmul accumulation order differs
                    "grouped_mm": 1e-4, "moe_topk_softmax": 1e-5, "moe_permute": 1e-6, "moe_unpermute": 1e-5,
                    "indexer_topk": 1e-5, "sparse_attention": 1e-4, "indexer_warmup_loss": 1e-5},
    torch.bfloat16: {"attention": 2e-2, "attention_block": 2e-2,
                     "rms_norm": 2e-2, "apply_rotary_emb": 2e-2, "swiglu": 2e-2, "adamw": 1e-2,
                     "swiglu_linear": 2e-2,
                     "grouped_mm": 2e-2, "moe_topk_softmax": 2e-2, "moe_permute": 2e-2, "moe_unpermute": 2e-2,
                     "indexer_topk": 2e-2, "sparse_attention": 2e-2, "indexer_warmup_loss": 2e-2},
}
ADAMW_STEPS = 3


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in fp32 (0 when both are zero)."""
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / scale if scale > 0 else (got - want).abs().max().item()


def compare(fused: Callable, ref: Callable, inputs: list[torch.Tensor], dtype: torch.dtype) -> tuple[float, float]:
    """(forward error, worst gradient error) of fused on `dtype` inputs against ref on the same values in fp32."""
    def run(fn, cast):
        leaves = [x.detach().to(cast).requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator(device="cpu").manual_seed(1)
        upstream = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
        torch.autograd.backward(outs, upstream)
        return [o.detach() for o in outs], [x.grad for x in leaves]

    f_out, f_grad = run(fused, dtype)
    r_out, r_grad = run(ref, torch.float32)
    fwd = max(relative_error(a, b) for a, b in zip(f_out, r_out))
    bwd = max(relative_error(a, b) for a, b in zip(f_grad, r_grad))
    return fwd, bwd


class _Block(torch.autograd.Function):
    """A block kernel of ring attention (ops/attention_blocks.py) as (out, lse), its backward the kernel's own
    backward given that out and lse (the gradient of lse is not one the ring needs)."""

    @staticmethod
    def forward(ctx, q, k, v, kernels, causal, mask):
        out, lse = kernels[0](q, k, v, causal, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.causal, ctx.mask = kernels, causal, mask
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return (*ctx.kernels[1](dout, *ctx.saved_tensors, ctx.causal, ctx.mask), None, None, None)


def _block_check(device_type: str, causal: bool, mask: torch.Tensor | None) -> tuple[Callable, Callable]:
    """(the device's block kernel, the plain-math one) as functions of q, k, v."""
    device_kernels = attention_blocks.block_kernels(device_type)
    math_kernels = (attention_blocks.math_block_attention, attention_blocks.math_block_attention_backward)
    return (lambda q, k, v: _Block.apply(q, k, v, device_kernels, causal, mask),
            lambda q, k, v: _Block.apply(q, k, v, math_kernels, causal, mask))


def cases(device: torch.device, quick: bool):
    """(op, description, fused fn, reference fn, inputs) for the op checks."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    attn_shapes = [(2, 37, 4, 4, 64), (2, 300, 8, 2, 64)] if quick else [
        (2, 37, 4, 4, 64), (2, 300, 8, 2, 64), (1, 2100, 8, 8, 128), (1, 4096, 32, 8, 128)]
    for b, s, h, kv, d in attn_shapes:
        desc = f"B={b} S={s} H={h} KV={kv} D={d}"
        yield ("attention", desc, dispatch.attention, reference.eager_attention,
               [randn(b, s, h, d), randn(b, s, kv, d), randn(b, s, kv, d)])
    # DeepSeek-V3's multi-head latent attention (models/deepseek_v3/model.py): q/k of head dim qk_nope + qk_rope
    # (128 + 64 = 192 for the published shapes), the value (v_head_dim 128) zero-padded to it and cut after, as
    # MindSpeed-LLM pads it (mindspeed_llm/tasks/models/transformer/multi_latent_attention.py).
    for b, s, h in [(1, 128, 4)] if quick else [(1, 128, 4), (1, 4096, 16)]:
        yield ("attention", f"B={b} S={s} H={h} D=192 MLA (v 128 padded to 192)",
               lambda q, k, v: dispatch.attention(q, k, F.pad(v, (0, 64)))[..., :128],
               lambda q, k, v: reference.eager_attention(q, k, F.pad(v, (0, 64)))[..., :128],
               [randn(b, s, h, 192), randn(b, s, h, 192), randn(b, s, h, 128)])
    # Attention within the documents of packed windows (data.document_mask): TND varlen npu_fusion_attention on
    # Ascend; a document runs in from the window before, others start inside and one at the window's start.
    for b, s, h, kv, d in [(2, 300, 8, 2, 64)] if quick else [(2, 300, 8, 2, 64), (1, 4096, 32, 8, 128)]:
        starts = [np.array([s // 5, s // 2]), np.array([0, s - 7])][:b]
        docs = Documents.from_starts(starts, s, reset_positions=False).to(device)
        yield ("attention", f"B={b} S={s} H={h} KV={kv} D={d} documents",
               functools.partial(dispatch.attention, documents=docs),
               functools.partial(reference.eager_attention, documents=docs),
               [randn(b, s, h, d), randn(b, s, kv, d), randn(b, s, kv, d)])
    if not quick:  # many short documents: 1,025 of two tokens, more than one TND call takes (at most 1K sequences)
        docs = Documents.from_starts([np.arange(2, 2050, 2)], 2050, reset_positions=False).to(device)
        yield ("attention", "B=1 S=2050 H=2 KV=1 D=64 1025 documents",
               functools.partial(dispatch.attention, documents=docs),
               functools.partial(reference.eager_attention, documents=docs),
               [randn(1, 2050, 2, 64), randn(1, 2050, 1, 64), randn(1, 2050, 1, 64)])
    # Ring attention's block kernel ([B, H, S, D], with its log-sum-exp; npu_fusion_attention and
    # npu_fusion_attention_grad on Ascend): a causal block, a block of earlier keys, a block with documents.
    for b, s, h, kv, d in [(2, 256, 8, 2, 64)] if quick else [(2, 256, 8, 2, 64), (1, 2048, 32, 8, 128)]:
        ids = torch.arange(s, device=device).div(s // 3 + 1, rounding_mode="floor")[None].expand(b, -1)
        same_document = (ids[:, :, None] == ids[:, None, :])[:, None]
        for desc, causal, sk, mask in (("causal", True, s, None), ("earlier keys", False, s // 2, None),
                                       ("documents", True, s, same_document)):
            yield ("attention_block", f"B={b} S={s} Sk={sk} H={h} KV={kv} D={d} {desc}",
                   *_block_check(device.type, causal, mask), [randn(b, h, s, d), randn(b, kv, sk, d),
                                                              randn(b, kv, sk, d)])
    for shape in ([(2, 37, 256)] if quick else [(2, 37, 256), (4, 2048, 4096)]):
        yield ("rms_norm", f"x={list(shape)}", lambda x, w: dispatch.rms_norm(x, w, 1e-5),
               lambda x, w: reference.rms_norm(x, w, 1e-5), [randn(*shape), randn(shape[-1]).abs() + 0.5])
    shape = (2, 37, 256)
    yield ("rms_norm", f"x={list(shape)} fp32 weight", lambda x, w: dispatch.rms_norm(x, w.float(), 1e-5),
           lambda x, w: reference.rms_norm(x, w, 1e-5), [randn(*shape), randn(shape[-1]).abs() + 0.5])
    for b, s, h, kv, d in ([(2, 37, 4, 2, 64)] if quick else [(2, 37, 4, 2, 64), (2, 2048, 32, 8, 128)]):
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(s).float(), inv_freq).to(device)
        cos, sin = angles.cos(), angles.sin()
        yield ("apply_rotary_emb", f"B={b} S={s} H={h} KV={kv} D={d}",
               lambda q, k, cos=cos, sin=sin: dispatch.apply_rotary_emb(q, k, cos, sin),
               lambda q, k, cos=cos, sin=sin: reference.apply_rotary_emb(q, k, cos, sin),
               [randn(b, s, h, d), randn(b, s, kv, d)])
    # MLA's RoPE slices: the last 64 channels of the 192-wide query heads (a strided view) and the key shared by every
    # head [B, S, 1, 64]; then its low-rank latents' norms (kv_lora_rank 512, q_lora_rank 1536).
    for b, s, h in ([(2, 37, 4)] if quick else [(2, 37, 4), (1, 2048, 128)]):
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
        angles = torch.outer(torch.arange(s).float(), inv_freq).to(device)
        cos, sin = angles.cos(), angles.sin()
        yield ("apply_rotary_emb", f"B={b} S={s} H={h} D=64 MLA rope slice of 192, shared key",
               lambda q, k, cos=cos, sin=sin: dispatch.apply_rotary_emb(q[..., 128:], k, cos, sin),
               lambda q, k, cos=cos, sin=sin: reference.apply_rotary_emb(q[..., 128:], k, cos, sin),
               [randn(b, s, h, 192), randn(b, s, 1, 64)])
    for shape in ([(2, 37, 512)] if quick else [(2, 37, 512), (2, 2048, 512), (2, 2048, 1536)]):
        yield ("rms_norm", f"x={list(shape)} MLA latent", lambda x, w: dispatch.rms_norm(x, w, 1e-6),
               lambda x, w: reference.rms_norm(x, w, 1e-6), [randn(*shape), randn(shape[-1]).abs() + 0.5])
    for shape in ([(2, 37, 128)] if quick else [(2, 37, 128), (2, 2048, 11008)]):
        yield ("swiglu", f"x={list(shape)}", dispatch.swiglu, reference.swiglu, [randn(*shape), randn(*shape)])
    # The MLP's input projections and gating in one kernel call (weights concatenated once tokens >= dim).
    for t, d, f in ([(74, 64, 96)] if quick else [(74, 64, 96), (4096, 4096, 11008)]):
        yield ("swiglu_linear", f"T={t} D={d} F={f}", dispatch.swiglu_linear,
               lambda x, a, b: reference.swiglu(reference.linear(x, a), reference.linear(x, b)),
               [randn(1, t, d), randn(f, d) * d**-0.5, randn(f, d) * d**-0.5])



def dsa_cases(device: torch.device, quick: bool, randn: Callable):
    """(op, description, fused fn, reference fn, inputs) for DeepSeek Sparse Attention's kernels."""
    # The indexer: each query's sum of the reference's scores over the keys selected (a different choice among
    # near-equal scores moves it little, a wrong one a lot); bf16 values, so both runs rank the same numbers.
    for b, s, h, d, topk in [(2, 128, 8, 64, 32)] if quick else [(2, 128, 8, 64, 32), (1, 4096, 64, 128, 2048)]:
        def chosen(select, q, k, w, topk=topk):
            keys = reference.selected_mask(select(q, k, w, topk), k.shape[1])
            return (reference.indexer_scores(q, k, w.float()) * keys).sum(-1)

        yield ("indexer_topk", f"B={b} S={s} H={h} D={d} top-{topk}",
               functools.partial(chosen, dispatch.indexer_topk), functools.partial(chosen, reference.indexer_topk),
               [randn(b, s, h, d).bfloat16().float(), randn(b, s, d).bfloat16().float(),
                randn(b, s, h).bfloat16().float()])
    # The attention over the selected keys as deepseek_v32 runs it: MLA's q/k of 192 (128 + 64 RoPE) per head and
    # the value (128) padded to 192, indices from a random ranking (some queries see fewer keys: -1 after them).
    for b, s, h, topk in [(2, 128, 4, 32)] if quick else [(2, 128, 4, 32), (1, 4096, 16, 2048)]:
        indices = reference.top_keys(randn(b, s, s), reference.visible_keys(b, s, device), topk)
        yield ("sparse_attention", f"B={b} S={s} H={h} D=192 top-{topk} MLA (v 128 padded to 192)",
               lambda q, k, v, i=indices: dispatch.sparse_attention(q, k, F.pad(v, (0, 64)), i)[..., :128],
               lambda q, k, v, i=indices: reference.sparse_attention(q, k, F.pad(v, (0, 64)), i)[..., :128],
               [randn(b, s, h, 192), randn(b, s, h, 192), randn(b, s, h, 128)])

    # The dense warm-up's KL loss and the indexer's gradients (MLA's q/k of 128 + 64 RoPE per head, frozen: cast to
    # the run's dtype inside, as the model hands them over without gradient). bf16 values throughout: the loss's
    # gradients move by some 5% when its inputs are rounded to bf16, which would hide the kernels' own error.
    for b, s, h, hi, di in [(2, 128, 4, 8, 64)] if quick else [(2, 128, 4, 8, 64), (1, 4096, 16, 64, 128)]:
        q, k = randn(b, s, h, 192).bfloat16().float(), randn(b, s, h, 192).bfloat16().float()
        yield ("indexer_warmup_loss", f"B={b} S={s} H={h} D=192 index H={hi} D={di}",
               lambda qi, ki, w, q=q, k=k: dispatch.indexer_warmup_loss(q.to(qi.dtype), k.to(qi.dtype), qi, ki, w, 64),
               lambda qi, ki, w, q=q, k=k: reference.indexer_warmup_loss(q, k, qi, ki, w, 64),
               [randn(b, s, hi, di).bfloat16().float(), randn(b, s, di).bfloat16().float(),
                randn(b, s, hi).bfloat16().float()])


def grouped_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM as a loop over the groups: rows offsets[g-1]:offsets[g] of x times w[g]^T."""
    starts = [0, *offsets.tolist()[:-1]]
    return torch.cat([x[a:b] @ w[g].T for g, (a, b) in enumerate(zip(starts, offsets.tolist()))])


def moe_cases(device: torch.device, quick: bool, randn: Callable):
    """(op, description, fused fn, reference fn, inputs) for the mixture-of-experts kernels."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    # (group sizes, K, M): uneven groups with an empty one; then Qwen3-30B-A3B-like expert shapes; 1,025 groups (more
    # than one call takes, at most 1,024)
    gemm_shapes = [([37, 0, 120, 5], 256, 512)] if quick else [
        ([37, 0, 120, 5], 256, 512), (torch.randint(0, 1024, (64,), generator=gen).tolist(), 2048, 768),
        (torch.randint(0, 4, (1025,), generator=gen).tolist(), 64, 64)]
    for sizes, k, m in gemm_shapes:
        offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
        yield ("grouped_mm", f"G={len(sizes)} N={sum(sizes)} K={k} M={m}",
               lambda x, w, o=offsets: dispatch.grouped_mm(x, w, o), lambda x, w, o=offsets: grouped_loop(x, w, o),
               [randn(sum(sizes), k), randn(len(sizes), m, k) * k**-0.5])
    for tokens, n_experts, top_k, dim in ([(74, 8, 2, 64)] if quick else [(74, 8, 2, 64), (8192, 128, 8, 2048)]):
        desc = f"T={tokens} E={n_experts} k={top_k}"

        def weights(fn, z, k=top_k):
            probs, experts = fn(z, k)
            return probs.gather(-1, experts)  # the chosen experts' probabilities, in descending order

        yield ("moe_topk_softmax", desc, lambda z, w=weights: w(dispatch.moe_topk_softmax, z),
               lambda z, w=weights: w(reference.moe_topk_softmax, z),
               [randn(tokens, n_experts).bfloat16().float()])  # bf16 values: both runs choose from the same logits
        experts = torch.rand(tokens, n_experts, generator=gen).topk(top_k, dim=-1).indices.to(device)
        order = torch.argsort(experts.reshape(-1), stable=True)
        yield ("moe_permute", desc + f" D={dim}", lambda x, e=experts: dispatch.moe_permute(x, e)[0],
               lambda x, e=experts: reference.moe_permute(x, e)[0], [randn(tokens, dim)])
        yield ("moe_unpermute", desc + f" D={dim}", lambda r, p, o=order: dispatch.moe_unpermute(r, o, p),
               lambda r, p, o=order: reference.moe_unpermute(r, o, p),
               [randn(tokens * top_k, dim), torch.rand(tokens, top_k, generator=gen).to(device)])
        # As the MoE layer uses them: the rows gathered by moe_permute's order (the capacity path reads the order),
        # and moe_permute's output and order fed to moe_unpermute (the two kernels' shared index convention).
        yield ("moe_permute", desc + f" D={dim} order", lambda x, e=experts, k=top_k: x.index_select(
                   0, dispatch.moe_permute(x, e)[1] // k), lambda x, e=experts: reference.moe_permute(x, e)[0],
               [randn(tokens, dim)])
        yield ("moe_unpermute", desc + f" D={dim} after moe_permute",
               lambda x, p, e=experts: dispatch.moe_unpermute(*dispatch.moe_permute(x, e), p),
               lambda x, p, e=experts: reference.moe_unpermute(*reference.moe_permute(x, e), p),
               [randn(tokens, dim), torch.rand(tokens, top_k, generator=gen).to(device)])


def check_fused_adamw(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(worst parameter error, 0) of torch's fused AdamW (the device's _fused_adamw_) against its for-loop AdamW."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    shapes = [(64, 48), (48,), (7, 3)]
    start = [torch.randn(*s, generator=gen).to(device) for s in shapes]
    grads = [[torch.randn(*s, generator=gen).to(device) for s in shapes] for _ in range(ADAMW_STEPS)]
    results = []
    for fused in (True, False):
        params = [torch.nn.Parameter(p.clone().to(dtype if fused else torch.float32)) for p in start]
        implementation = {"fused": True} if fused else {"foreach": False}
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **implementation)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(p.dtype)
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append(params)
    return max(relative_error(a, b) for a, b in zip(*results)), 0.0


def bench_attention(device, dtype: torch.dtype, seq: int, repeats: int = 5) -> None:
    """Forward + backward milliseconds of the fused kernel and of the eager baseline at Llama-7B head shapes."""
    b, h, d = 1, 32, 128
    q, k, v = (torch.randn(b, seq, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dev = setup_device()
    for name, use_flash in (("fused", True), ("eager", False)):
        times = []
        for _ in range(repeats + 1):
            synchronize(dev)
            t0 = time.perf_counter()
            dispatch.attention(q, k, v, causal=True, use_flash=use_flash).sum().backward()
            synchronize(dev)
            times.append(time.perf_counter() - t0)
        print(f"  bench attention {name:5s} {str(dtype)[6:]:8s} S={seq:5d}: {1000 * min(times[1:]):8.2f} ms (fwd+bwd)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes only")
    p.add_argument("--bench", action="store_true", help="time fused vs eager attention")
    args = p.parse_args(argv)

    dev = setup_device()
    device = dev.torch_device
    kernels = current_kernels(dev.type)
    print(f"device: {dev.type} ({dev.name}); kernels: {', '.join(f'{k}={v}' for k, v in kernels.items())}")
    dtypes = [torch.float32] + ([torch.bfloat16] if dev.type != "cpu" or not args.quick else [])
    failures = 0
    gen = torch.Generator(device="cpu").manual_seed(4)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    moe, dsa = moe_cases(device, args.quick, randn), dsa_cases(device, args.quick, randn)
    for op, desc, fused, ref, inputs in (*cases(device, args.quick), *moe, *dsa):
        for dtype in dtypes:
            try:
                fwd, bwd = compare(fused, ref, inputs, dtype)
                ok = fwd <= TOLERANCE[dtype][op] and bwd <= TOLERANCE[dtype][op]
                detail = f"fwd {fwd:.2e} bwd {bwd:.2e} (tol {TOLERANCE[dtype][op]:.0e})"
            except Exception as e:  # a kernel that rejects the input is a failure to report, not a crash
                ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            failures += not ok
            kernel = kernels.get(op, device.type)  # the block kernel follows the device, not the op dispatch
            print(f"{'PASS' if ok else 'FAIL'}  {op:16s} [{kernel}] {str(dtype)[6:]:8s} {desc:28s} {detail}")
    for dtype in dtypes:
        try:
            err, _ = check_fused_adamw(device, dtype)
            ok, detail = err <= TOLERANCE[dtype]["adamw"], f"params {err:.2e} (tol {TOLERANCE[dtype]['adamw']:.0e})"
        except Exception as e:  # a device without the fused kernel is a failure to report, not a crash
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {'adamw':16s} [fused]  {str(dtype)[6:]:8s} {f'{ADAMW_STEPS} steps':28s} "
              f"{detail}")
    if args.bench and dev.type != "cpu":
        for seq in (2048, 4096):
            bench_attention(device, torch.bfloat16, seq)
    print(f"op check: {'PASS' if failures == 0 else f'FAIL ({failures} failed)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

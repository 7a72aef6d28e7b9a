"""Plain PyTorch training loops over the benchmark shapes: our Transformer, and transformers' LlamaForCausalLM.

    python benchmarks/bare_loop.py --shape S2 --dtype bf16 --model ours --steps 10 --warmup 2
    python benchmarks/bare_loop.py --shape S1 --kernels-from /tmp/before/titan_npu/ops/reference.py --steps 20

A step is the least a training step can be: forward, fp32 cross entropy, backward, gradient-norm clipping, AdamW
(fused where the device has it), zero_grad -- on batches made once up front, with no data loader, logging,
schedule or checks. benchmarks/compare.py runs these side by side with the trainer; both build the model the
same way, so any difference between them is the trainer's own cost (or gain).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_npu.models.llama import LlamaArgs, Transformer


@dataclass(frozen=True)
class Shape:
    """A benchmark model and batch."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    seq_len: int
    batch_size: int
    rope_theta: float = 5e5
    norm_eps: float = 1e-5


SHAPES: dict[str, Shape] = {
    # 6.16 M parameters: small matmuls, so element-wise work and per-op overhead weigh in.
    "S1": Shape(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, ffn_dim=768, seq_len=256,
                batch_size=8),
    # 35.7 M parameters: matmul-bound.
    "S2": Shape(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=8192, ffn_dim=1536, seq_len=256,
                batch_size=8),
    # For tests of the benchmark code itself.
    "tiny": Shape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, seq_len=32,
                  batch_size=2),
}

# Precision modes: fp32; bf16 = fp32 weights and optimizer, autocast compute; bf16-pure = everything in bf16.
DTYPES = ("fp32", "bf16", "bf16-pure")


def llama_args(shape: Shape, use_flash_attention: bool = True) -> LlamaArgs:
    """Our model arguments for a shape."""
    return LlamaArgs(dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
                     vocab_size=shape.vocab_size, ffn_dim=shape.ffn_dim, max_seq_len=shape.seq_len,
                     rope_theta=shape.rope_theta, norm_eps=shape.norm_eps, use_flash_attention=use_flash_attention,
                     family="llama3", flavor="bench")


def trainer_overrides(shape: Shape) -> list[str]:
    """The same shape as command-line overrides of the trainer's config."""
    return [
        "--model.dim", str(shape.dim), "--model.n_layers", str(shape.n_layers),
        "--model.n_heads", str(shape.n_heads), "--model.n_kv_heads", str(shape.n_kv_heads),
        "--model.vocab_size", str(shape.vocab_size), "--model.ffn_dim", str(shape.ffn_dim),
        "--model.rope_theta", str(shape.rope_theta), "--model.norm_eps", str(shape.norm_eps),
        "--model.max_seq_len", str(shape.seq_len), "--training.seq_len", str(shape.seq_len),
        "--training.batch_size", str(shape.batch_size),
    ]


def dtype_overrides(dtype: str) -> list[str]:
    """A precision mode as trainer overrides."""
    if dtype == "bf16-pure":
        return ["--training.dtype", "bf16", "--training.mixed_precision", "false"]
    return ["--training.dtype", dtype, "--training.mixed_precision", "true"]


def flops_per_token(shape: Shape) -> float:
    """6 x (parameters minus the input embedding) + 12 x layers x dim x seq (the step line's convention)."""
    args = llama_args(shape)
    return 6.0 * args.num_params(exclude_embedding=True) + 12.0 * shape.n_layers * shape.dim * shape.seq_len


def default_device() -> torch.device:
    """The device the trainer would pick (npu > cuda > xpu > cpu, or TITAN_DEVICE)."""
    from titan_npu.device import setup_device

    return setup_device().torch_device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on cpu)."""
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    if mod is not None:
        mod.synchronize()


def build_ours(shape: Shape, dtype: str, device: torch.device, use_flash_attention: bool = True) -> nn.Module:
    """Our Transformer, materialised and initialised the way the trainer does it."""
    with torch.device("meta"):
        model = Transformer(llama_args(shape, use_flash_attention))
    if dtype == "bf16-pure":
        model.to(torch.bfloat16)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


class _LogitsOnly(nn.Module):
    """tokens -> logits for a transformers causal LM, without the KV cache."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits


def build_hf(shape: Shape, dtype: str, device: torch.device) -> nn.Module:
    """transformers' LlamaForCausalLM of the same shape, SDPA attention, untied output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.dim, intermediate_size=shape.ffn_dim,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=shape.seq_len, rope_theta=shape.rope_theta, rms_norm_eps=shape.norm_eps,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    with torch.device(device):
        lm = LlamaForCausalLM(config)
    if dtype == "bf16-pure":
        lm.to(torch.bfloat16)
    return _LogitsOnly(lm)


class PlainLoop:
    """forward, fp32 cross entropy, backward, clip, AdamW, zero_grad -- over a few fixed random batches."""

    def __init__(self, model: nn.Module, shape: Shape, dtype: str, device: torch.device, lr: float = 3e-4,
                 weight_decay: float = 0.1, max_norm: float = 1.0, implementation: str = "fused",
                 n_batches: int = 4, seed: int = 0) -> None:
        self.model = model.train()
        self.device = device
        self.max_norm = max_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Weight decay on matrices, none on norm scales: the usual grouping (and the trainer's).
        groups = [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}]
        kwargs = {"fused": True} if implementation == "fused" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)
        self.autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        if dtype == "bf16":
            self.autocast = lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(n_batches):
            tokens = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len + 1), generator=g)
            self.batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        self.i = 0
        self.tokens_per_step = shape.batch_size * shape.seq_len

    def step(self) -> torch.Tensor:
        """One optimizer step; returns the loss (on the device, not synchronised)."""
        inputs, labels = self.batches[self.i % len(self.batches)]
        self.i += 1
        with self.autocast():
            logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def build_loop(model_kind: str, shape: Shape, dtype: str, device: torch.device, implementation: str = "fused",
               use_flash_attention: bool = True) -> PlainLoop:
    """A PlainLoop over our model ('ours') or transformers' ('hf')."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    if model_kind == "ours":
        model = build_ours(shape, dtype, device, use_flash_attention)
    elif model_kind == "hf":
        model = build_hf(shape, dtype, device)
    else:
        raise ValueError(f"model {model_kind!r} is not 'ours' or 'hf'")
    return PlainLoop(model, shape, dtype, device, implementation=implementation)


def compare_kernels(shape: Shape, dtype: str, other_reference: str, reps: int, device: torch.device) -> dict:
    """Forward + backward of our model with another file's reference kernels (A) and the current ones (B), in
    turns A B A B ... in this one process: paired ratios resolve differences of a percent or two."""
    import importlib.util
    import statistics

    from titan_npu import ops

    spec = importlib.util.spec_from_file_location("other_reference", other_reference)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    model = build_ours(shape, dtype, device)
    loop = PlainLoop(model, shape, dtype, device)
    inputs, labels = loop.batches[0]
    # The other file's ops become the device's backend ("auto"); "reference" is the current code.
    ops.register_backend(device.type, {name: getattr(other, name) for name in ops.OP_NAMES if hasattr(other, name)})

    def forward_backward(kernels: str) -> float:
        ops.set_kernels(kernels)
        synchronize(device)
        t0 = time.perf_counter()
        with loop.autocast():
            logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        model.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - t0

    try:
        for kernels in ("auto", "reference") * 2:
            forward_backward(kernels)
        times = [(forward_backward("auto"), forward_backward("reference")) for _ in range(reps)]
    finally:
        ops.set_kernels("auto")
    ratios = sorted(b / a for a, b in times)
    return {"other_ms": statistics.median(a for a, _ in times) * 1e3,
            "current_ms": statistics.median(b for _, b in times) * 1e3,
            "ratio_median": statistics.median(ratios), "ratio_q1": ratios[len(ratios) // 4],
            "ratio_q3": ratios[(3 * len(ratios)) // 4]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="S1")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--model", choices=("ours", "hf"), default="ours")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kernels-from", metavar="REFERENCE_PY",
                   help="time forward+backward with this file's reference kernels against the current ones")
    args = p.parse_args(argv)
    device = default_device()
    shape = SHAPES[args.shape]
    if args.kernels_from:
        r = compare_kernels(shape, args.dtype, args.kernels_from, args.steps, device)
        print(f"{args.shape} {args.dtype} forward+backward on {device}: {args.kernels_from} {r['other_ms']:.1f} ms, "
              f"current {r['current_ms']:.1f} ms; current/other paired median {r['ratio_median']:.3f} "
              f"(quartiles {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}, {args.steps} pairs)")
        return 0
    loop = build_loop(args.model, shape, args.dtype, device)
    for _ in range(args.warmup):
        loop.step()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = loop.step()
    synchronize(device)
    seconds = time.perf_counter() - t0
    tps = loop.tokens_per_step * args.steps / seconds
    print(f"{args.model} {args.shape} {args.dtype} on {device}: {tps:,.0f} tokens/s, "
          f"{tps * flops_per_token(shape) / 1e12:.3g} TFLOP/s, {seconds / args.steps * 1e3:.1f} ms/step, "
          f"loss {float(loss):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

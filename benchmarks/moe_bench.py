"""Mixture-of-experts speed, in one process, paired: every repeat times each candidate once, in a rotated order.

    OMP_NUM_THREADS=1 python benchmarks/moe_bench.py                       # both parts, 5 repeats
    OMP_NUM_THREADS=1 python benchmarks/moe_bench.py --part layer --repeats 9 --tokens 4096

(a) model: configs/debug_moe.toml's model (8 experts of 128, top-2) against a dense Qwen3 of the same shapes whose
    MLP has the width of the active experts (ffn_dim = top_k x moe_ffn_dim = 256): the same matmul FLOPs per token
    but for the router. A step is the plain loop of benchmarks/bare_loop.py (forward, fp32 cross entropy plus the
    MoE model's auxiliary loss, backward, clipping, fused AdamW: the trainer's choice on a CPU) on fixed random
    batches; tokens/s per step.
(b) layer: one MoE layer (debug_moe's shape) forward + backward over --tokens tokens with its experts run three ways:
    the grouped GEMM the layer uses (ops.grouped_mm: torch._grouped_mm on the CPU), a Python loop over the experts
    (a matmul per expert, the group sizes read to the host), and the padded batched fallback (one bmm over the
    experts' rows padded to the token count, reference.padded_grouped_mm).

Each repeat warms every candidate up once, then times `--steps` calls of each, interleaved call by call (the order
rotated by one each repeat), and keeps each candidate's median; the figures are the medians over the repeats, and
the ratios the medians of the per-repeat ratios (candidate / first candidate), so load on a shared machine moves
both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bare_loop import PlainLoop, Shape, synchronize  # noqa: E402

from titan_npu import ops  # noqa: E402
from titan_npu.config.loader import load_config  # noqa: E402
from titan_npu.models.moe.args import MoEArgs  # noqa: E402
from titan_npu.models.moe.layer import MoE  # noqa: E402
from titan_npu.models.registry import build_model, build_model_args  # noqa: E402
from titan_npu.ops import reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MOE_CONFIG = ROOT / "configs" / "debug_moe.toml"
# The dense model: debug_moe's shapes with every layer one MLP (mlp_only_layers) as wide as the active experts,
# untied like qwen3_moe debug. (A --model.name qwen3 would be refused: the file's MoE keys are not a qwen3 key.)
DENSE_OVERRIDES = ["--model.mlp_only_layers", "[0, 1, 2, 3]", "--model.ffn_dim", "256",
                   "--model.tie_embeddings", "false"]


class RoutedLoop(PlainLoop):
    """bare_loop's plain step, with a MoE model's auxiliary loss added to the optimised loss as the trainer does."""

    def step(self) -> torch.Tensor:
        """One optimizer step; returns the cross entropy (on the device)."""
        inputs, labels = self.batches[self.i % len(self.batches)]
        self.i += 1
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        aux = self.model.auxiliary_loss() if hasattr(self.model, "auxiliary_loss") else None
        (loss if aux is None else loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def build_step(overrides: list[str], device: torch.device) -> tuple[RoutedLoop, int, int]:
    """(the loop, parameters, active parameters per token) of debug_moe's config with `overrides`, fp32."""
    cfg = load_config(MOE_CONFIG, overrides)
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    t = cfg.training
    shape = Shape(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                  vocab_size=args.vocab_size, ffn_dim=args.ffn_dim, seq_len=t.seq_len, batch_size=t.batch_size)
    # optimizer.implementation = "auto" is fused AdamW on a CPU (trainer/optimizer.py): time the step the trainer runs.
    loop = RoutedLoop(model, shape, "fp32", device, implementation="fused")
    return loop, args.num_params(), args.num_active_params()


def loop_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_group_rows: int | None = None
                    ) -> torch.Tensor:
    """The grouped GEMM as a Python loop over the experts (a host read of the group ends, a matmul each)."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[a:b] @ w[g].T for g, (a, b) in enumerate(zip(starts, ends))])


EXPERT_KERNELS: dict[str, Callable] = {
    "grouped": reference.grouped_mm,
    "loop": loop_grouped_mm,
    "padded": lambda x, w, offsets, max_group_rows=None: reference.padded_grouped_mm(x, w, offsets, max_group_rows),
}


def paired(candidates: dict[str, Callable[[], object]], repeats: int, steps: int, device: torch.device
           ) -> dict[str, list[float]]:
    """Per candidate, its median step seconds in each repeat. A repeat warms every candidate up once, then times
    `steps` calls of each interleaved call by call (A B A B ..., repeat r starting with candidate r mod n), so the
    calls compared sit a step apart and a burst of load on a shared host falls on both sides of a ratio."""
    names = list(candidates)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        rotated = names[r % len(names):] + names[:r % len(names)]
        for name in rotated:
            candidates[name]()
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(steps):
            for name in rotated:
                synchronize(device)
                t0 = time.perf_counter()
                candidates[name]()
                synchronize(device)
                times[name].append(time.perf_counter() - t0)
        for name in names:
            seconds[name].append(statistics.median(times[name]))
    return seconds


def summarise(seconds: dict[str, list[float]], work: float = 0.0) -> dict[str, dict[str, float]]:
    """Median seconds (and work / s when work is given) and the median paired ratio to the first candidate."""
    first = next(iter(seconds.values()))
    out = {}
    for name, values in seconds.items():
        ratios = [v / f for v, f in zip(values, first)]
        row = {"median_s": statistics.median(values), "ratio_to_first": statistics.median(ratios),
               "ratio_range": [min(ratios), max(ratios)]}
        if work:
            row["per_s"] = work / row["median_s"]
            row["rate_ratio_to_first"] = statistics.median(1 / x for x in ratios)
            row["rate_ratio_range"] = [1 / max(ratios), 1 / min(ratios)]
        out[name] = row
    return out


def model_part(repeats: int, steps: int, device: torch.device) -> dict:
    """debug_moe vs the dense Qwen3 of the same active FLOPs: tokens/s of a training step."""
    torch.manual_seed(0)
    moe, moe_params, moe_active = build_step([], device)
    dense, dense_params, _ = build_step(DENSE_OVERRIDES, device)
    seconds = paired({"debug_moe": moe.step, "dense": dense.step}, repeats, steps, device)
    result = summarise(seconds, work=moe.tokens_per_step)
    result["debug_moe"].update(params=moe_params, active_params=moe_active)
    result["dense"].update(params=dense_params, active_params=dense_params)
    return {"tokens_per_step": moe.tokens_per_step, "candidates": result}


def layer_part(repeats: int, steps: int, tokens: int, device: torch.device) -> dict:
    """One debug_moe MoE layer, forward + backward, its experts run by each of EXPERT_KERNELS."""
    cfg = load_config(MOE_CONFIG)
    m = cfg.model
    torch.manual_seed(0)
    layer = MoE(MoEArgs(dim=m.dim, n_experts=m.n_experts, top_k=m.top_k, ffn_dim=m.moe_ffn_dim)).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, m.dim, device=device, requires_grad=True)
    for name, fn in EXPERT_KERNELS.items():
        ops.register_backend(f"bench_{name}", {"grouped_mm": fn})

    def run(name: str) -> Callable[[], None]:
        def fwd_bwd() -> None:
            ops.set_kernels("auto", grouped_mm=f"bench_{name}")
            out, _ = layer(x)
            out.square().mean().backward()
            layer.zero_grad(set_to_none=True)
            x.grad = None
        return fwd_bwd

    try:
        seconds = paired({name: run(name) for name in EXPERT_KERNELS}, repeats, steps, device)
    finally:
        ops.set_kernels("auto")
    return {"tokens": tokens, "dim": m.dim, "n_experts": m.n_experts, "moe_ffn_dim": m.moe_ffn_dim, "top_k": m.top_k,
            "candidates": summarise(seconds)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("all", "model", "layer"), default="all")
    p.add_argument("--repeats", type=int, default=5, help="paired rounds (each times every candidate once)")
    p.add_argument("--steps", type=int, default=5, help="timed calls per candidate and round (median kept)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens through the single MoE layer")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    device = torch.device("cpu")
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "steps": args.steps}
    if args.part in ("all", "model"):
        report["model"] = model_part(args.repeats, args.steps, device)
    if args.part in ("all", "layer"):
        report["layer"] = layer_part(args.repeats, args.steps, args.tokens, device)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"torch {report['torch']}, {report['threads']} thread(s), {args.repeats} paired repeats x {args.steps} "
          f"steps (medians; ratios are medians of per-repeat ratios)")
    if "model" in report:
        r = report["model"]
        print(f"(a) training step, {r['tokens_per_step']} tokens:")
        for name, row in r["candidates"].items():
            print(f"  {name:10s} {row['params'] / 1e6:5.2f}M params ({row['active_params'] / 1e6:.2f}M active): "
                  f"{row['per_s']:8,.0f} tokens/s, {1e3 * row['median_s']:7.1f} ms/step, tokens/s vs debug_moe "
                  f"{row['rate_ratio_to_first']:.3f} "
                  f"({row['rate_ratio_range'][0]:.3f}-{row['rate_ratio_range'][1]:.3f})")
    if "layer" in report:
        r = report["layer"]
        print(f"(b) one MoE layer fwd+bwd, {r['tokens']} tokens, dim {r['dim']}, {r['n_experts']} experts of "
              f"{r['moe_ffn_dim']}, top-{r['top_k']}:")
        for name, row in r["candidates"].items():
            print(f"  {name:10s} {1e3 * row['median_s']:7.1f} ms, time vs grouped {row['ratio_to_first']:.2f}x "
                  f"({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

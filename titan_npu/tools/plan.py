"""`titan-npu plan`: per-rank memory of the config's layout, whether it fits, and the fastest layouts that do.

    titan-npu plan --config configs/llama2_70b.toml --nodes 8 --devices-per-node 8 --device 910B2
    titan-npu plan --config configs/llama2_7b.toml --nodes 1 --devices-per-node 4 --json
    titan-npu plan --config configs/llama2_7b.toml --nodes 1 --devices-per-node 4 --verify --rank 3

Every candidate keeps the config's global batch (sequences per optimizer step): a plan that silently changed it
would change the training run, not only its speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.tools.memory_model import (
    AC_MODES,
    GiB,
    Job,
    Layout,
    MemoryBreakdown,
    estimate_memory,
    job_from_config,
    layout_from_config,
)
from titan_npu.tools.perf_model import DEVICES, Hardware, StepEstimate, estimate_step, hardware

# Fraction of usable memory a plan may fill: the allocator's fragmentation needs the rest.
FIT_FRACTION = 0.95
MICRO_BATCHES = (1, 2, 4, 8, 16)
# Llama 2 and 3 pretrained with ~4M-token batches; far larger global batches at the same lr are a common cause of
# loss oscillation in the guides' runs.
LARGE_GLOBAL_BATCH_TOKENS = 4 * 1024 * 1024


@dataclass(frozen=True)
class Candidate:
    """One layout with its memory and speed estimate."""

    layout: Layout
    memory: MemoryBreakdown
    step: StepEstimate
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "layout": {
                "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
                "fsdp": lay.fsdp, "activation_checkpoint": lay.ac, "selective_every": lay.selective_every,
                "batch_size": lay.batch_size, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
                "pp_microbatches": lay.n_microbatches if lay.pp > 1 else 0, "pp_schedule": lay.pp_schedule,
                "cpu_offload": lay.cpu_offload,
            },
            "memory_bytes": self.memory.as_dict(),
            "memory_gib": {k: round(v / GiB, 2) for k, v in self.memory.as_dict().items()
                           if k not in ("stage", "rank")},
            "fits": self.fits,
            "estimate": self.step.as_dict(),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, efficiency: float,
             hccl_buffsize_mb: int = 0) -> Candidate:
    """Memory and speed of one layout."""
    memory = estimate_memory(job, layout, hw.device_type, hccl_buffsize_mb)
    step = estimate_step(job, layout, hw, devices_per_node, efficiency)
    return Candidate(layout, memory, step, int(hw.memory_bytes * FIT_FRACTION))


def candidate_layouts(job: Job, base: Layout, world_size: int, devices_per_node: int,
                      global_batch: int) -> list[Layout]:
    """Layouts of `world_size` ranks that keep `global_batch` sequences per step and divide the model evenly.

    tp stays inside a node and divides both head counts; pp divides the layer count; dp_replicate > 1 only
    replicates across nodes (HSDP: shard inside, replicate across); activation checkpointing none/selective/full;
    a micro-batch from 1 to 16 with gradient accumulation making up the rest; CPU offload as a last resort.
    """
    a = job.args
    out = []
    for tp in _divisors(devices_per_node):
        if a.n_heads % tp or a.n_kv_heads % tp or tp > 8:
            continue
        for pp in _divisors(world_size // tp):
            if pp > a.n_layers or a.n_layers % pp or pp > 16:
                continue
            dp = world_size // (tp * pp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            # HSDP: replicate across nodes while the shard group (dp_shard x tp ranks) stays inside one.
            replicas = [1] + [r for r in _divisors(dp) if r > 1 and (dp // r) * tp <= devices_per_node]
            for dp_replicate in replicas:
                dp_shard = dp // dp_replicate
                n_micro = (base.pp_microbatches or 2 * pp) if pp > 1 else 1
                for mb in MICRO_BATCHES:
                    per_pass = mb * n_micro
                    if local % per_pass:
                        continue
                    for ac in AC_MODES:
                        for offload in (False, True):
                            if offload and not (base.fsdp and dp_shard > 1):
                                continue
                            out.append(replace(
                                base, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ac=ac,
                                batch_size=per_pass, grad_accum=local // per_pass,
                                pp_microbatches=n_micro if pp > 1 else base.pp_microbatches, cpu_offload=offload,
                            ))
    return out


def rank_candidates(candidates: list[Candidate]) -> list[Candidate]:
    """Layouts that fit, fastest first (ties: more headroom first), one row per layout (its best micro-batch).

    CPU offload is a last resort: its layouts are listed only when nothing fits without it, since the host-side
    optimizer step and PCIe traffic make it slower in practice than the estimate can show.
    """
    fitting = [c for c in candidates if c.fits and not c.layout.cpu_offload]
    if not fitting:
        fitting = [c for c in candidates if c.fits]
    fitting.sort(key=lambda c: (-round(c.step.tokens_per_s, 6), c.memory.total))
    seen, ranked = set(), []
    for c in fitting:
        lay = c.layout
        key = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.ac, lay.cpu_offload)
        if key not in seen:
            seen.add(key)
            ranked.append(c)
    return ranked


@dataclass(frozen=True)
class Plan:
    job: Job
    hw: Hardware
    nodes: int
    devices_per_node: int
    config_candidate: Candidate | None
    config_error: str | None
    ranked: list[Candidate]
    global_batch: int
    efficiency: float

    def as_dict(self) -> dict:
        a = self.job.args
        return {
            "model": {"family": a.family, "flavor": a.flavor, "params": a.num_params(), "dim": a.dim,
                      "n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
                      "ffn_dim": a.ffn_dim, "vocab_size": a.vocab_size},
            "training": {"seq_len": self.job.seq_len, "dtype": self.job.dtype, "optimizer": self.job.optimizer,
                         "global_batch_sequences": self.global_batch,
                         "global_batch_tokens": self.global_batch * self.job.seq_len},
            "cluster": {"nodes": self.nodes, "devices_per_node": self.devices_per_node, "device": self.hw.name,
                        "device_type": self.hw.device_type, "memory_gib": self.hw.memory_bytes / GiB,
                        "usable_gib": self.hw.memory_bytes * FIT_FRACTION / GiB,
                        "peak_tflops": self.hw.peak_flops / 1e12,
                        "intra_node_gbs": self.hw.intra_node_bw / 1e9, "inter_node_gbs": self.hw.inter_node_bw / 1e9,
                        "assumed_efficiency": self.efficiency},
            "config_layout": self.config_candidate.as_dict() if self.config_candidate else None,
            "config_error": self.config_error,
            "ranked": [c.as_dict() for c in self.ranked],
        }


def make_plan(cfg: JobConfig, nodes: int, devices_per_node: int, hw: Hardware, efficiency: float = 0.4,
              top: int = 10) -> Plan:
    """Evaluate the config's own layout and rank every candidate layout that fits."""
    if nodes < 1 or devices_per_node < 1:
        raise ConfigError(f"--nodes {nodes} --devices-per-node {devices_per_node}: both must be >= 1")
    world = nodes * devices_per_node
    job = job_from_config(cfg)
    if cfg.training.seq_len > job.args.max_seq_len:
        raise ConfigError(f"training.seq_len={cfg.training.seq_len} exceeds model.max_seq_len={job.args.max_seq_len}"
                          "; lower training.seq_len or raise model.max_seq_len")
    buffsize = cfg.comm.hccl_buffsize_mb
    config_candidate, config_error = None, None
    try:
        base = layout_from_config(cfg, world)
        config_candidate = evaluate(job, base, hw, devices_per_node, efficiency, buffsize)
    except LayoutError as e:
        config_error = str(e)
        base = Layout(fsdp=cfg.parallel.fsdp, selective_every=cfg.activation_checkpoint.selective_every,
                      pp_schedule=cfg.parallel.pp_schedule, loss_parallel=cfg.parallel.loss_parallel,
                      reshard_after_forward=cfg.parallel.reshard_after_forward)
    global_batch = (config_candidate.layout.batch_size * config_candidate.layout.grad_accum
                    * config_candidate.layout.dp) if config_candidate else (
        cfg.training.batch_size * cfg.training.gradient_accumulation_steps * world)
    candidates = [evaluate(job, lay, hw, devices_per_node, efficiency, buffsize)
                  for lay in candidate_layouts(job, base, world, devices_per_node, global_batch)]
    return Plan(job, hw, nodes, devices_per_node, config_candidate, config_error, rank_candidates(candidates)[:top],
                global_batch, efficiency)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def format_breakdown(c: Candidate) -> list[str]:
    """Per-rank memory lines of one candidate."""
    m, lay = c.memory, c.layout
    shard = f"sharded over {lay.dp_shard}" if lay.shards_parameters else "replicated"
    if lay.tp > 1:
        shard += f", tp {lay.tp}"
    where = f"rank {m.rank}" + (f", pipeline stage {m.stage} of {lay.pp}" if lay.pp > 1 else "")
    ac = {"none": "no checkpointing", "full": "full checkpointing",
          "selective": f"1 block in {lay.selective_every} checkpointed"}[lay.ac]
    rows = [
        (f"parameters (fp32, {shard})", m.parameters),
        ("gradients (fp32)", m.gradients),
        ("optimizer state", m.optimizer),
        (f"activations (micro-batch {lay.micro_batch}, {ac})", m.activations),
        ("temporary (logits/loss, unsharded FSDP or autocast copies)", m.temporary),
        ("communication buffers", m.communication),
        ("runtime reserve", m.runtime),
    ]
    lines = [f"per-rank memory ({where}):"]
    lines += [f"  {label:<62} {_gib(value):>7} GiB" for label, value in rows]
    if lay.cpu_offload:
        lines.append(f"  {'(offloaded to host memory: parameters, gradients, optimizer)':<62} "
                     f"{_gib(m.host_offload):>7} GiB")
    verdict = "fits" if c.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<62} {_gib(m.total):>7} GiB of {_gib(c.usable_bytes)} usable -> {verdict}")
    return lines


def format_table(ranked: list[Candidate]) -> list[str]:
    """The ranked layouts as a fixed-width table."""
    header = (f"{'#':>2}  {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3}  {'AC':<9} {'mb':>3} {'accum':>5} "
              f"{'offload':>7}  {'mem/rank':>9}  {'tokens/s':>10}  {'MFU':>5}")
    lines = [header, "-" * len(header)]
    for i, c in enumerate(ranked, 1):
        lay = c.layout
        ac = f"sel/{lay.selective_every}" if lay.ac == "selective" else lay.ac
        lines.append(
            f"{i:>2}  {lay.dp_replicate:>6} {lay.dp_shard:>8} {lay.tp:>3} {lay.pp:>3}  {ac:<9} {lay.micro_batch:>3} "
            f"{lay.grad_accum:>5} {('yes' if lay.cpu_offload else 'no'):>7}  {_gib(c.memory.total):>5} GiB  "
            f"{c.step.tokens_per_s:>10,.0f}  {100 * c.step.mfu:>4.1f}%"
        )
    return lines


def format_plan(plan: Plan) -> str:
    """The plan as text: model, cluster, the config's layout, then the ranked table."""
    a, hw = plan.job.args, plan.hw
    tokens = plan.global_batch * plan.job.seq_len
    lines = [
        f"model: {a.family} {a.flavor}, {a.num_params() / 1e9:.2f}B parameters (dim {a.dim}, {a.n_layers} layers, "
        f"{a.n_heads}/{a.n_kv_heads} heads, ffn {a.ffn_dim}, vocab {a.vocab_size}); seq {plan.job.seq_len}, "
        f"{plan.job.dtype}, {plan.job.optimizer}",
        f"cluster: {plan.nodes} node(s) x {plan.devices_per_node} {hw.name} ({_gib(hw.memory_bytes)} GiB, "
        f"{hw.peak_flops / 1e12:.0f} TFLOP/s bf16; {hw.intra_link} {hw.intra_node_bw / 1e9:.0f} GB/s, "
        f"{hw.inter_link} {hw.inter_node_bw / 1e9:.0f} GB/s; compute at {100 * plan.efficiency:.0f}% of peak)",
        f"global batch: {plan.global_batch} sequences = {tokens:,} tokens per step (kept by every layout below)",
    ]
    if tokens > LARGE_GLOBAL_BATCH_TOKENS:
        lines.append(f"note: {tokens / 2**20:.1f}M tokens per step is above the ~4M Llama 2/3 pretrained with; "
                     "raise the lr warm-up or lower gradient_accumulation_steps if the loss oscillates")
    lines.append("")
    if plan.config_candidate is not None:
        c = plan.config_candidate
        lines.append(f"config layout: {c.layout.describe()}")
        lines += format_breakdown(c)
        s = c.step
        lines.append(f"estimate: {s.tokens_per_s:,.0f} tokens/s, MFU {100 * s.mfu:.1f}%, step {s.step_time:.2f}s "
                     f"(compute {s.compute:.2f}s, tp {s.tp_comm:.2f}s, bubble {s.bubble:.2f}s, "
                     f"exposed fsdp {s.fsdp_exposed:.2f}s, offload {s.offload:.2f}s)")
    else:
        lines.append(f"config layout does not apply to {plan.nodes * plan.devices_per_node} ranks: {plan.config_error}")
    lines.append("")
    if plan.ranked:
        lines.append("layouts that fit, fastest first:")
        lines += format_table(plan.ranked)
        best = plan.ranked[0].layout
        lines.append("")
        lines.append("to use #1: " + config_overrides(best))
    else:
        lines.append("no layout fits: use more devices, a shorter training.seq_len, or a smaller global batch")
    return "\n".join(lines)


def config_overrides(layout: Layout) -> str:
    """The command-line overrides that select a layout."""
    parts = [f"--parallel.dp_replicate {layout.dp_replicate}", f"--parallel.dp_shard {layout.dp_shard}",
             f"--parallel.tp_degree {layout.tp}", f"--parallel.pp_degree {layout.pp}",
             f"--activation_checkpoint.mode {layout.ac}", f"--training.batch_size {layout.batch_size}",
             f"--training.gradient_accumulation_steps {layout.grad_accum}"]
    if layout.pp > 1:
        parts.append(f"--parallel.pp_microbatches {layout.n_microbatches}")
    if layout.cpu_offload:
        parts.append("--parallel.cpu_offload true")
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-npu plan",
        description="Per-rank memory of a config's layout, whether it fits, and the fastest layouts that do. "
                    "Config keys can be overridden as --section.key value.",
    )
    p.add_argument("--config", help="TOML or YAML config file")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device", default="910B2", help=f"device kind ({', '.join(s.name for s in DEVICES.values())})")
    p.add_argument("--device-memory", help="memory per device, e.g. 64GB (default: the device's)")
    p.add_argument("--intra-node-bw", type=float, help="effective collective bandwidth inside a node, GB/s")
    p.add_argument("--inter-node-bw", type=float, help="effective collective bandwidth between nodes, GB/s")
    p.add_argument("--efficiency", type=float, default=0.4, help="fraction of peak FLOPs compute reaches (0.4)")
    p.add_argument("--top", type=int, default=10, help="how many ranked layouts to show")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also build the real parallelized model for --rank on the meta device and compare")
    p.add_argument("--rank", type=int, default=0, help="rank the --verify dry run builds (default 0)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu plan`."""
    from titan_npu.config import load_config

    args, overrides = build_parser().parse_known_args(argv)
    if not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency {args.efficiency} must be in (0, 1]; 0.3-0.5 is typical")
    cfg = load_config(args.config, overrides)
    hw = hardware(args.device, args.device_memory, args.intra_node_bw, args.inter_node_bw)
    plan = make_plan(cfg, args.nodes, args.devices_per_node, hw, args.efficiency, args.top)
    report = plan.as_dict()
    ok = True
    verify_text = ""
    if args.verify:
        from titan_npu.tools.dry_run import compare_with_plan, dry_run

        result = dry_run(cfg, args.nodes * args.devices_per_node, args.rank, device_type=hw.device_type)
        comparison = compare_with_plan(result, cfg)
        ok = comparison["match"]
        report["verify"] = {"dry_run": result.as_dict(), "comparison": comparison}
        verify_text = "\n" + result.format() + "\n" + comparison["text"]
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(format_plan(plan) + verify_text)
    fits = plan.config_candidate is not None and plan.config_candidate.fits
    return 0 if ok and fits else 1

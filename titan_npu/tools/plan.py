"""`titan-npu plan`: per-rank memory of the config's layout, whether it fits, and the fastest layouts that do.

    titan-npu plan --config configs/llama2_70b.toml --nodes 8 --devices-per-node 8 --device 910B2
    titan-npu plan --config configs/llama2_7b.toml --nodes 1 --devices-per-node 4 --json
    titan-npu plan --config configs/llama2_7b.toml --nodes 1 --devices-per-node 4 --verify --rank 3

Every candidate keeps the config's global batch (sequences per optimizer step): a plan that silently changed it
would change the training run, not only its speed. Candidates pass the same layout checks as the trainer
(parallel/layout.py). Exit code 0 when the config's own layout fits (and --verify agrees), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.tools.memory_model import (
    GiB,
    Job,
    Layout,
    MemoryBreakdown,
    estimate_memory,
    job_from_config,
    layout_from_config,
)
from titan_npu.tools.perf_model import DEVICES, Hardware, StepEstimate, estimate_step, hardware

# Fraction of device memory a plan may fill: the allocator's fragmentation needs the rest.
FIT_FRACTION = 0.95
MICRO_BATCHES = (1, 2, 4, 8, 16)
MAX_TP, MAX_PP = 8, 16
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
                "selective_ops": lay.selective_ops, "batch_size": lay.batch_size, "grad_accum": lay.grad_accum,
                "micro_batch": lay.micro_batch, "pp_microbatches": lay.n_microbatches if lay.pp > 1 else 0,
                "pp_schedule": lay.pp_schedule, "cpu_offload": lay.cpu_offload, "overrides": config_overrides(lay),
            },
            "memory_bytes": self.memory.as_dict(),
            "memory_gib": {k: round(v / GiB, 2) for k, v in self.memory.as_dict().items()
                           if k not in ("rank", "pp_rank")},
            "usable_gib": round(self.usable_bytes / GiB, 2),
            "fits": self.fits,
            "estimate": self.step.as_dict(),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def usable_fraction(cfg: JobConfig) -> float:
    """Share of device memory a plan may fill: FIT_FRACTION, or less when training.memory_fraction caps it."""
    cap = cfg.training.memory_fraction
    return min(FIT_FRACTION, cap) if cap > 0 else FIT_FRACTION


def evaluate(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, efficiency: float,
             hccl_buffsize_mb: int = 0, fraction: float = FIT_FRACTION) -> Candidate:
    """Memory and speed of one layout."""
    memory = estimate_memory(job, layout, hw.device_type, hccl_buffsize_mb)
    step = estimate_step(job, layout, hw, devices_per_node, efficiency)
    return Candidate(layout, memory, step, int(hw.memory_bytes * fraction))


def config_for_layout(cfg: JobConfig, layout: Layout) -> JobConfig:
    """A copy of the config that selects `layout` (what config_overrides says on the command line)."""
    return replace(
        cfg,
        parallel=replace(cfg.parallel, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                         tp_degree=layout.tp, pp_degree=layout.pp, pp_microbatches=layout.pp_microbatches,
                         cpu_offload=layout.cpu_offload),
        activation_checkpoint=replace(cfg.activation_checkpoint, mode=layout.ac, selective_ops=layout.selective_ops,
                                      selective_every=layout.selective_every),
        training=replace(cfg.training, batch_size=layout.batch_size,
                         gradient_accumulation_steps=layout.grad_accum),
    )


def config_overrides(layout: Layout) -> str:
    """The command-line overrides that select a layout."""
    parts = [f"--parallel.dp_replicate {layout.dp_replicate}", f"--parallel.dp_shard {layout.dp_shard}",
             f"--parallel.tp_degree {layout.tp}", f"--parallel.pp_degree {layout.pp}",
             f"--activation_checkpoint.mode {layout.ac}"]
    if layout.ac == "selective":
        parts.append(f"--activation_checkpoint.selective_ops {str(layout.selective_ops).lower()}")
    parts += [f"--training.batch_size {layout.batch_size}",
              f"--training.gradient_accumulation_steps {layout.grad_accum}"]
    if layout.pp > 1:
        parts.append(f"--parallel.pp_microbatches {layout.n_microbatches}")
    if layout.cpu_offload:
        parts.append("--parallel.cpu_offload true")
    return " ".join(parts)


def check_layout(cfg: JobConfig, job: Job, world_size: int) -> None:
    """The trainer's own layout checks (head, vocab, sequence and micro-batch splits); raises LayoutError."""
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.layout import validate_layout

    validate_layout(ParallelDims.from_config(cfg.parallel, world_size), job.args, cfg)


def is_valid(cfg: JobConfig, job: Job, layout: Layout) -> bool:
    """Whether the trainer would accept `layout` for this config."""
    try:
        check_layout(config_for_layout(cfg, layout), job, layout.world_size)
    except LayoutError:
        return False
    return True


def candidate_layouts(cfg: JobConfig, job: Job, base: Layout, world_size: int, devices_per_node: int,
                      global_batch: int) -> list[Layout]:
    """Layouts of `world_size` ranks that keep `global_batch` sequences per step and pass the layout checks.

    tp stays inside a node; pp up to 16 stages; dp_replicate > 1 only as HSDP whose shard group stays inside a
    node; activation checkpointing none / selective every Nth block / selective ops / full; a micro-batch from 1 to
    16 with accumulation (or, under pipelining, micro-batches) making up the rest; CPU offload as a last resort.
    """
    a = job.args
    acs = [("none", False), ("selective", False), ("selective", True), ("full", False)]
    out = []
    for tp in _divisors(devices_per_node):
        if tp > MAX_TP or a.n_heads % tp or a.n_kv_heads % tp:
            continue
        for pp in _divisors(world_size // tp):
            if pp > min(MAX_PP, a.n_layers):
                continue
            dp = world_size // (tp * pp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            replicas = [1] + [r for r in _divisors(dp) if r > 1 and (dp // r) * tp <= devices_per_node]
            for dp_replicate in replicas:
                dp_shard = dp // dp_replicate
                for mb in MICRO_BATCHES:
                    if local % mb:
                        continue
                    if pp == 1:
                        split = {"batch_size": mb, "grad_accum": local // mb, "pp_microbatches": 0}
                    else:
                        # Under pipelining the whole local batch is one pipeline step of local / mb micro-batches.
                        split = {"batch_size": local, "grad_accum": 1, "pp_microbatches": local // mb}
                    for ac, ops in acs:
                        for offload in (False, True):
                            if offload and not (base.fsdp and dp_shard > 1):
                                continue
                            try:
                                layout = replace(base, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp,
                                                 ac=ac, selective_ops=ops, cpu_offload=offload, **split)
                            except LayoutError:
                                continue
                            if is_valid(cfg, job, layout):
                                out.append(layout)
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
        key = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.ac, lay.selective_ops, lay.cpu_offload)
        if key not in seen:
            seen.add(key)
            ranked.append(c)
    return ranked


@dataclass(frozen=True)
class Plan:
    """The config's layout evaluated, and the ranked alternatives."""

    job: Job
    hw: Hardware
    nodes: int
    devices_per_node: int
    config_candidate: Candidate | None
    config_error: str | None
    ranked: list[Candidate]
    global_batch: int
    efficiency: float
    fraction: float = FIT_FRACTION

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
                        "usable_gib": self.hw.memory_bytes * self.fraction / GiB,
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
    fraction = usable_fraction(cfg)
    config_candidate, config_error = None, None
    try:
        base = layout_from_config(cfg, world)
        check_layout(cfg, job, world)
        config_candidate = evaluate(job, base, hw, devices_per_node, efficiency, buffsize, fraction)
        global_batch = base.local_batch * base.dp
    except LayoutError as e:
        config_error = str(e)
        p, ac = cfg.parallel, cfg.activation_checkpoint
        base = Layout(fsdp=p.fsdp, selective_every=ac.selective_every, pp_schedule=p.pp_schedule,
                      pp_virtual_stages=p.pp_virtual_stages, loss_parallel=p.loss_parallel,
                      reshard_after_forward=p.reshard_after_forward,
                      loss_chunk_tokens=cfg.training.loss_chunk_tokens)
        # Without a valid layout the global batch is the config's per-rank batch over pure data parallelism.
        global_batch = cfg.training.batch_size * cfg.training.gradient_accumulation_steps * world
    candidates = [evaluate(job, lay, hw, devices_per_node, efficiency, buffsize, fraction)
                  for lay in candidate_layouts(cfg, job, base, world, devices_per_node, global_batch)]
    return Plan(job, hw, nodes, devices_per_node, config_candidate, config_error, rank_candidates(candidates)[:top],
                global_batch, efficiency, fraction)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _ac_label(layout: Layout) -> str:
    if layout.ac == "selective":
        return "sel-ops" if layout.selective_ops else f"sel/{layout.selective_every}"
    return layout.ac


def format_breakdown(c: Candidate) -> list[str]:
    """Per-rank memory lines of one candidate."""
    m, lay = c.memory, c.layout
    shard = f"sharded over {lay.dp_shard}" if lay.shards_parameters else "not sharded"
    if lay.tp > 1:
        shard += f", tp {lay.tp}"
    where = f"rank {m.rank}" + (f", pipeline rank {m.pp_rank} of {lay.pp}" if lay.pp > 1 else "")
    ac = {"none": "no checkpointing", "full": "full checkpointing"}.get(lay.ac) or (
        "selective ops" if lay.selective_ops else f"1 block in {lay.selective_every} checkpointed")
    rows = [
        (f"parameters (fp32, {shard})", m.parameters),
        ("gradients (fp32)", m.gradients),
        ("optimizer state", m.optimizer),
        (f"activations (micro-batch {lay.micro_batch}, {ac})", m.activations),
        ("temporary (loss/recompute, unsharded FSDP or autocast copies)", m.temporary),
        ("communication buffers", m.communication),
        ("runtime reserve", m.runtime),
    ]
    lines = [f"per-rank memory ({where}, the busiest):"]
    lines += [f"  {label:<64} {_gib(value):>7} GiB" for label, value in rows]
    if lay.cpu_offload:
        lines.append(f"  {'(in host memory instead: parameters, gradients, optimizer)':<64} "
                     f"{_gib(m.host_offload):>7} GiB")
    verdict = "fits" if c.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<64} {_gib(m.total):>7} GiB of {_gib(c.usable_bytes)} usable -> {verdict}")
    return lines


def format_table(ranked: list[Candidate]) -> list[str]:
    """The ranked layouts as a fixed-width table ('passes': accumulation steps or pipeline micro-batches)."""
    header = (f"{'#':>2}  {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3}  {'AC':<8} {'mb':>3} {'passes':>6} "
              f"{'offload':>7}  {'mem/rank':>9}  {'tokens/s':>10}  {'MFU':>5}")
    lines = [header, "-" * len(header)]
    for i, c in enumerate(ranked, 1):
        lay = c.layout
        lines.append(
            f"{i:>2}  {lay.dp_replicate:>6} {lay.dp_shard:>8} {lay.tp:>3} {lay.pp:>3}  {_ac_label(lay):<8} "
            f"{lay.micro_batch:>3} {lay.passes:>6} {('yes' if lay.cpu_offload else 'no'):>7}  "
            f"{_gib(c.memory.total):>5} GiB  {c.step.tokens_per_s:>10,.0f}  {100 * c.step.mfu:>4.1f}%"
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
                     "if the loss oscillates, lower gradient_accumulation_steps or the peak lr")
    lines.append("")
    if plan.config_candidate is not None:
        c = plan.config_candidate
        lines.append(f"config layout: {c.layout.describe()}")
        lines += format_breakdown(c)
        s = c.step
        lines.append(f"estimate: {s.tokens_per_s:,.0f} tokens/s, MFU {100 * s.mfu:.1f}%, step {s.step_time:.2f}s "
                     f"(compute {s.compute:.2f}s, tp {s.tp_comm:.2f}s, pp {s.pp_comm + s.bubble:.2f}s, "
                     f"exposed fsdp {s.fsdp_exposed:.2f}s, offload {s.offload:.2f}s)")
    else:
        lines.append(f"config layout does not apply to {plan.nodes * plan.devices_per_node} ranks: {plan.config_error}")
    lines.append("")
    if plan.ranked:
        lines.append("layouts that fit, fastest first:")
        lines += format_table(plan.ranked)
        lines += ["", "to use #1: " + config_overrides(plan.ranked[0].layout)]
    else:
        lines.append("no layout fits: use more devices, a shorter training.seq_len, or a smaller global batch")
    return "\n".join(lines)


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


def _refuse_mixture_of_experts(cfg: JobConfig) -> None:
    """A ConfigError for a model whose tokens meet only some of its parameters (MoE): not modelled yet."""
    from titan_npu.models.registry import build_model_args

    a = build_model_args(cfg.model)
    if a.num_active_params() != a.num_params():
        raise ConfigError(f"titan-npu plan does not model mixture-of-experts models yet (model.name="
                          f"'{cfg.model.name}': expert memory, routing and all-to-all traffic); size the run by hand "
                          f"(docs/moe.md)")


def main(argv: list[str]) -> int:
    """Entry of `titan-npu plan`."""
    from titan_npu.config.loader import load_config

    args, overrides = build_parser().parse_known_args(argv)
    if not 0 < args.efficiency <= 1:
        raise ConfigError(f"--efficiency {args.efficiency} must be in (0, 1]; 0.3-0.5 is typical")
    cfg = load_config(args.config, overrides)
    _refuse_mixture_of_experts(cfg)
    hw = hardware(args.device, args.device_memory, args.intra_node_bw, args.inter_node_bw)
    plan = make_plan(cfg, args.nodes, args.devices_per_node, hw, args.efficiency, args.top)
    report = plan.as_dict()
    agree = True
    verify_text = ""
    if args.verify:
        if plan.config_candidate is None:
            raise LayoutError(f"--verify needs a valid config layout: {plan.config_error}")
        from titan_npu.tools.dry_run import compare_with_plan, dry_run

        result = dry_run(cfg, args.nodes * args.devices_per_node, args.rank, device_type=hw.device_type)
        comparison = compare_with_plan(result, cfg)
        agree = comparison["match"]
        report["verify"] = {"dry_run": result.as_dict(), "comparison": comparison}
        verify_text = "\n\n" + result.format() + "\n" + comparison["text"]
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(format_plan(plan) + verify_text)
    fits = plan.config_candidate is not None and plan.config_candidate.fits
    return 0 if agree and fits else 1

"""The planner's search: every layout of the job's ranks that the trainer would accept and that keeps the config's
global batch, each with its memory and speed estimate, ranked fastest first among those that fit."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from titan_npu.config.schema import JobConfig
from titan_npu.config.validate import check_seq_len
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.intmath import divisors
from titan_npu.models.registry import spec_of
from titan_npu.parallel.arithmetic import V_SCHEDULES, v_min_microbatches
from titan_npu.parallel.degrees import Degrees
from titan_npu.parallel.layout import check_context_parallel, validate_layout
from titan_npu.planner.hardware import Hardware
from titan_npu.planner.layout import GiB, Job, Layout, job_from_config, layout_from_config
from titan_npu.planner.memory import MemoryBreakdown, estimate_memory
from titan_npu.planner.perf import StepEstimate, estimate_step

# Fraction of device memory a plan may fill: the allocator's fragmentation needs the rest.
FIT_FRACTION = 0.95
MICRO_BATCHES = (1, 2, 4, 8, 16)
MAX_TP, MAX_PP = 8, 16


@dataclass(frozen=True)
class Candidate:
    """One layout with its memory and speed estimate."""

    layout: Layout
    memory: MemoryBreakdown
    step: StepEstimate
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return fits_in(self.memory, self.usable_bytes)

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "layout": {
                "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
                "cp": lay.cp, "cp_mode": lay.cp_mode, "cp_ulysses": lay.cp_ulysses, "ep": lay.ep,
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


def usable_fraction(cfg: JobConfig) -> float:
    """Share of device memory a plan may fill: FIT_FRACTION, or less when training.memory_fraction caps it."""
    cap = cfg.training.memory_fraction
    return min(FIT_FRACTION, cap) if cap > 0 else FIT_FRACTION


def fits_in(memory: MemoryBreakdown, usable_bytes: int) -> bool:
    """Whether a rank's peak memory fits in what a plan may fill."""
    return memory.total <= usable_bytes


def evaluate(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, efficiency: float | None,
             hccl_buffsize_mb: int = 0, fraction: float = FIT_FRACTION) -> Candidate:
    """Memory and speed of one layout."""
    memory = estimate_memory(job, layout, hw.device_type, hccl_buffsize_mb)
    step = estimate_step(job, layout, hw, devices_per_node, efficiency)
    return Candidate(layout, memory, step, int(hw.memory_bytes * fraction))


def evaluate_fitting(job: Job, layout: Layout, hw: Hardware, devices_per_node: int, efficiency: float | None,
                     hccl_buffsize_mb: int = 0, fraction: float = FIT_FRACTION) -> Candidate | None:
    """evaluate() of a layout that fits; None, with no step estimate, for one that does not (the search ranks and
    counts only layouts that fit: rank_candidates, least_cp)."""
    memory = estimate_memory(job, layout, hw.device_type, hccl_buffsize_mb)
    usable = int(hw.memory_bytes * fraction)
    if not fits_in(memory, usable):
        return None
    return Candidate(layout, memory, estimate_step(job, layout, hw, devices_per_node, efficiency), usable)


def config_for_layout(cfg: JobConfig, layout: Layout, made: dict | None = None) -> JobConfig:
    """A copy of the config that selects `layout` (what config_overrides says on the command line); `made` keeps
    the sections already copied from this `cfg` for reuse (a search makes thousands of configs that share them)."""
    ulysses = layout.cp_ulysses if layout.cp_ulysses > 1 else cfg.parallel.cp_ulysses_degree
    changes = {
        "parallel": dict(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp_degree=layout.tp,
                         pp_degree=layout.pp, pp_microbatches=layout.pp_microbatches, cp_degree=layout.cp,
                         cp_mode=layout.cp_mode, ep_degree=layout.ep, cp_ulysses_degree=ulysses,
                         cpu_offload=layout.cpu_offload, pp_schedule=layout.pp_schedule),
        "activation_checkpoint": dict(mode=layout.ac, selective_ops=layout.selective_ops,
                                      selective_every=layout.selective_every, offload=layout.act_offload),
        "training": dict(batch_size=layout.batch_size, gradient_accumulation_steps=layout.grad_accum),
    }
    if made is None:
        return replace(cfg, **{name: replace(getattr(cfg, name), **values) for name, values in changes.items()})
    sections = {}
    for name, values in changes.items():
        key = (name, *values.items())
        if key not in made:
            made[key] = replace(getattr(cfg, name), **values)
        sections[name] = made[key]
    return replace(cfg, **sections)


def config_overrides(layout: Layout) -> str:
    """The command-line overrides that select a layout, whatever degrees and checkpointing the config had."""
    parts = [f"--parallel.dp_replicate {layout.dp_replicate}", f"--parallel.dp_shard {layout.dp_shard}",
             f"--parallel.tp_degree {layout.tp}", f"--parallel.pp_degree {layout.pp}",
             f"--parallel.cp_degree {layout.cp}", f"--parallel.ep_degree {layout.ep}",
             f"--activation_checkpoint.mode {layout.ac}"]
    if layout.cp > 1:
        parts.append(f"--parallel.cp_mode {layout.cp_mode}")
        if layout.cp_ulysses > 1:
            parts.append(f"--parallel.cp_ulysses_degree {layout.cp_ulysses}")
    parts.append(f"--activation_checkpoint.selective_ops {str(layout.selective_ops).lower()}")
    parts.append(f"--activation_checkpoint.offload {str(layout.act_offload).lower()}")
    parts += [f"--training.batch_size {layout.batch_size}",
              f"--training.gradient_accumulation_steps {layout.grad_accum}"]
    if layout.pp > 1:
        parts.append(f"--parallel.pp_microbatches {layout.n_microbatches}")
        parts.append(f"--parallel.pp_schedule {layout.pp_schedule}")
    if layout.cpu_offload:
        parts.append("--parallel.cpu_offload true")
    return " ".join(parts)


def check_layout(cfg: JobConfig, job: Job, degrees: Degrees) -> None:
    """The trainer's own layout checks (parallel/layout.py: head, vocab, sequence and micro-batch splits, and what
    MoE layers accept under tensor, expert, pipeline and context parallelism) and the model family's own refusals
    (ModelSpec.check_layout, what its parallelize refuses) of `degrees` with the config's other settings; raises
    LayoutError."""
    validate_layout(degrees, job.args, cfg)
    spec_of(job.args).check_layout(degrees, job.args, cfg)


def is_valid(cfg: JobConfig, job: Job, layout: Layout, made: dict | None = None) -> bool:
    """Whether the trainer would accept `layout` for this config (`made`: config_for_layout's)."""
    try:
        check_layout(config_for_layout(cfg, layout, made), job, layout.degrees)
    except LayoutError:
        return False
    return True


def candidate_layouts(cfg: JobConfig, job: Job, base: Layout, world_size: int, devices_per_node: int,
                      global_batch: int, offload_activations: bool = False) -> list[Layout]:
    """Layouts of `world_size` ranks that keep `global_batch` sequences per step and pass the layout checks.

    tp stays inside a node; pp up to 16 stages; context parallelism (ring or Ulysses) over any divisor of the
    ranks; dp_replicate > 1 only as HSDP whose shard group stays inside a node; for a MoE model, expert parallelism
    over any ep dividing dp_shard and the experts; activation checkpointing none / selective every Nth block /
    selective ops / full, and with offload_activations (an accelerator's plan) none / selective every Nth block
    with activation offload (the blocks not recomputed keep their saved tensors in host memory: rank_candidates says
    when they are listed); under pipelining the config's schedule and ZBVZeroBubble; a micro-batch from 1 to 16
    with accumulation (or, under pipelining, micro-batches) making up the rest; CPU offload as a last resort.
    """
    a = job.args
    acs = [("none", False, False), ("selective", False, False), ("selective", True, False), ("full", False, False)]
    if offload_activations:  # the blocks kept by no or selective checkpointing in host memory instead
        acs += [("none", False, True), ("selective", False, True)]
    experts = spec_of(a).experts
    n_routed = experts.n_routed(a) if experts is not None and experts.n_moe_blocks(a) else 0
    out: list[Layout] = []
    made: dict = {}  # config sections shared by the candidates' configs
    for tp, cp, cp_mode, cp_ulysses in _model_parallel_degrees(cfg, job, world_size, devices_per_node):
        for pp in divisors(world_size // (tp * cp)):
            if pp > min(MAX_PP, a.n_layers):
                continue
            dp = world_size // (tp * pp * cp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            replicas = [1] + [r for r in divisors(dp) if r > 1 and (dp // r) * tp * cp <= devices_per_node]
            # ep from the FSDP ranks (dp_shard x cp) for a MoE model only; parallel/layout.py refuses what the MoE
            # layers cannot run.
            for dp_replicate, ep in [(r, e) for r in replicas for e in divisors(dp // r * cp)
                                     if e == 1 or (n_routed and n_routed % e == 0)]:
                dp_shard = dp // dp_replicate
                try:
                    degrees = Degrees(dp_replicate, dp_shard, tp, pp, cp, ep, cp_mode, cp_ulysses, base.fsdp)
                except LayoutError:
                    continue
                for mb in MICRO_BATCHES:
                    if local % mb:
                        continue
                    if pp == 1:
                        split = {"batch_size": mb, "grad_accum": local // mb, "pp_microbatches": 0}
                    else:
                        # Under pipelining the whole local batch is one pipeline step of local / mb micro-batches.
                        split = {"batch_size": local, "grad_accum": 1, "pp_microbatches": local // mb}
                    schedules = _schedules(base, pp, a.n_layers, split["pp_microbatches"])
                    for schedule, (ac, ops, act_offload), offload in product(schedules, acs, (False, True)):
                        if offload and not (base.fsdp and dp_shard > 1):
                            continue
                        try:
                            layout = replace(base, degrees=degrees, ac=ac, selective_ops=ops, cpu_offload=offload,
                                             act_offload=act_offload, pp_schedule=schedule, **split)
                        except LayoutError:
                            continue
                        if is_valid(cfg, job, layout, made):
                            out.append(layout)
    return out


def _schedules(base: Layout, pp: int, n_layers: int, n_microbatches: int) -> tuple[str, ...]:
    """Pipeline schedules to try at `pp`: the config's, and ZBVZeroBubble where the config leaves the stages per
    rank to the schedule, every stage of its V gets a layer (2 pp of them; unequal stages are fine) and the
    micro-batches fill it (parallel/layout.py's rules, checked here first because they are cheap); for a config
    naming a V schedule, 1F1B where its V does not fit. DualPipeV is
    not tried: as run here (its paired forward and backward one after the other) it has ZBVZeroBubble's bubble with
    one more micro-batch in flight, so it never ranks above it; a config that names it is planned as it is."""
    if pp == 1:
        return (base.pp_schedule,)
    fits_v = (base.pp_virtual_stages in (0, 2) and n_layers >= 2 * pp
              and n_microbatches >= v_min_microbatches("ZBVZeroBubble", pp))
    if base.pp_schedule in V_SCHEDULES:  # a V config: 1F1B where its V does not fit this pp
        return tuple(dict.fromkeys((base.pp_schedule, "ZBVZeroBubble"))) if fits_v else ("1F1B",)
    return (base.pp_schedule, "ZBVZeroBubble") if fits_v and base.pp_virtual_stages == 0 else (base.pp_schedule,)


def _model_parallel_degrees(cfg: JobConfig, job: Job, world_size: int, devices_per_node: int
                            ) -> list[tuple[int, int, str, int]]:
    """(tp, cp, cp_mode, cp_ulysses) to try: tp inside a node splitting the heads; cp any divisor of the ranks left,
    ring, Ulysses, or hybrid with each Ulysses group size between, kept only where the layout checks let them split
    the heads and sequences (so the search does not grow with the divisors of an absurd world size)."""
    a = job.args
    out = []
    for tp in divisors(devices_per_node):
        if tp > MAX_TP or a.n_heads % tp or a.n_kv_heads % tp:
            continue
        for cp in divisors(world_size // tp):
            tries = [(tp, cp, "ring", 1)]
            if cp > 1:
                tries.append((tp, cp, "ulysses", 1))
                tries += [(tp, cp, "hybrid", u) for u in divisors(cp) if 1 < u < cp]
            out += [t for t in tries if t[1] == 1 or _context_parallel_fits(cfg, job, *t)]
    return out


def _context_parallel_fits(cfg: JobConfig, job: Job, tp: int, cp: int, cp_mode: str, cp_ulysses: int) -> bool:
    try:
        check_context_parallel(cp, cp_mode, cp_ulysses, tp, job.args, cfg)
    except LayoutError:
        return False
    return True


def usable_candidates(candidates: list[Candidate], offload_activations: bool = False) -> list[Candidate]:
    """The layouts that fit which a plan lists: without CPU offload or activation offload; activation offload's
    too where the config turns it on (`offload_activations`) or nothing fits without it; CPU offload's only where
    nothing fits without that."""
    fitting = [c for c in candidates if c.fits and not c.layout.cpu_offload]
    chosen = [c for c in fitting if offload_activations or not c.layout.act_offload] or fitting
    return chosen or [c for c in candidates if c.fits]


def rank_candidates(candidates: list[Candidate], offload_activations: bool = False) -> list[Candidate]:
    """Layouts that fit, fastest first (ties: without activation offload, then more headroom first), one row per
    layout (its best micro-batch).

    The offloads are for tight memory (usable_candidates). CPU offload is a last resort, since the host-side
    optimizer step and PCIe traffic make it slower in practice than the estimate can show; activation offload comes
    in where the config asks for it or nothing fits without it: it needs pinned host memory the planner does not
    know the size of (the offloaded bytes in flight on every rank of a node) and its overlap with compute is an
    assumption until measured on the device.
    """
    fitting = usable_candidates(candidates, offload_activations)
    # At equal speed, without activation offload first (it holds host memory and the host link), then by headroom.
    fitting.sort(key=lambda c: (-round(c.step.tokens_per_s, 6), c.layout.act_offload, c.memory.total))
    seen, ranked = set(), []
    for c in fitting:
        lay = c.layout
        key = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.cp_mode, lay.cp_ulysses, lay.ep, lay.ac,
               lay.selective_ops, lay.cpu_offload, lay.act_offload)
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
    least_cp: int = 1  # the smallest cp_degree of any layout that fits (0: none fits)

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
            "least_cp_that_fits": self.least_cp,
            "ranked": [c.as_dict() for c in self.ranked],
        }


def make_plan(cfg: JobConfig, nodes: int, devices_per_node: int, hw: Hardware, efficiency: float | None = None,
              top: int = 10) -> Plan:
    """Evaluate the config's own layout and rank every candidate layout that fits (efficiency None: the device
    type's calibrated one, planner/calibration.py)."""
    if efficiency is None:
        from titan_npu.planner.efficiency import calibrated_efficiency

        efficiency = calibrated_efficiency(hw.device_type)
    if nodes < 1 or devices_per_node < 1:
        raise ConfigError(f"--nodes {nodes} --devices-per-node {devices_per_node}: both must be >= 1")
    world = nodes * devices_per_node
    job = job_from_config(cfg)
    if job.float8 is not None and not job.float8.emulate and not hw.peak_float8_flops:
        raise ConfigError(f"float8.enable = true: the {hw.name} has no float8 tensor cores (no float8 peak in the "
                          f"table); plan for a device that has them (H100, H200, H800, H20) or set float8.enable = "
                          f"false")
    check_seq_len(cfg.training.seq_len, job.args.max_seq_len)
    buffsize = cfg.comm.hccl_buffsize_mb
    fraction = usable_fraction(cfg)
    config_candidate, config_error = None, None
    try:
        base = layout_from_config(cfg, world)
        check_layout(cfg, job, base.degrees)
        config_candidate = evaluate(job, base, hw, devices_per_node, efficiency, buffsize, fraction)
        global_batch = base.local_batch * base.dp
    except LayoutError as e:
        config_error = str(e)
        p, ac = cfg.parallel, cfg.activation_checkpoint
        base = Layout(Degrees(fsdp=p.fsdp, cp_mode=p.cp_mode), selective_every=ac.selective_every,
                      pp_schedule=p.pp_schedule, pp_virtual_stages=p.pp_virtual_stages, loss_parallel=p.loss_parallel,
                      reshard_after_forward=p.reshard_after_forward, loss_chunk_tokens=cfg.training.loss_chunk_tokens,
                      offload_min_bytes=ac.offload_min_bytes)
        # Without a valid layout the global batch is the config's per-rank batch over pure data parallelism.
        global_batch = cfg.training.batch_size * cfg.training.gradient_accumulation_steps * world
    # Only the layouts that fit are ranked or counted below: the others are dropped unestimated.
    evaluated = (evaluate_fitting(job, lay, hw, devices_per_node, efficiency, buffsize, fraction)
                 for lay in candidate_layouts(cfg, job, base, world, devices_per_node, global_batch,
                                              offload_activations=hw.device_type != "cpu"))
    candidates = [c for c in evaluated if c is not None]
    # The offloads come in where memory is tight (usable_candidates): a cp that fits only with one counts only when
    # nothing fits without it.
    offload_activations = cfg.activation_checkpoint.offload
    least_cp = min((c.layout.cp for c in usable_candidates(candidates, offload_activations)), default=0)
    return Plan(job, hw, nodes, devices_per_node, config_candidate, config_error,
                rank_candidates(candidates, offload_activations)[:top], global_batch, efficiency, fraction, least_cp)

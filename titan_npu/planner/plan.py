"""The plan as a person reads it: the model and cluster, the config's layout with its per-rank memory, and the
ranked table of layouts that fit (`titan-npu plan`).

Every candidate keeps the config's global batch (sequences per optimizer step): a plan that silently changed it
would change the training run, not only its speed. Candidates pass the same layout checks as the trainer
(parallel/layout.py).
"""

from __future__ import annotations

from titan_npu.models.registry import spec_of
from titan_npu.planner.efficiency import calibrated_efficiency, error_band
from titan_npu.planner.layout import GiB, Layout
from titan_npu.planner.search import Candidate, Plan, config_overrides

# Llama 2 and 3 pretrained with ~4M-token batches; far larger global batches at the same lr are a common cause of
# loss oscillation in the guides' runs.
LARGE_GLOBAL_BATCH_TOKENS = 4 * 1024 * 1024


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _ac_label(layout: Layout) -> str:
    if layout.ac == "selective":
        return "sel-ops" if layout.selective_ops else f"sel/{layout.selective_every}"
    return layout.ac


def format_breakdown(c: Candidate) -> list[str]:
    """Per-rank memory lines of one candidate."""
    m, lay = c.memory, c.layout
    shard = f"sharded over {lay.fsdp_shards}" if lay.fsdp_enabled else "not sharded"
    if lay.tp > 1:
        shard += f", tp {lay.tp}"
    if lay.ep > 1:
        shard += f", experts over ep {lay.ep}"
    where = f"rank {m.rank}" + (f", pipeline rank {m.pp_rank} of {lay.pp}" if lay.pp > 1 else "")
    ac = {"none": "no checkpointing", "full": "full checkpointing"}.get(lay.ac) or (
        "selective ops" if lay.selective_ops else f"1 block in {lay.selective_every} checkpointed")
    rows = [
        (f"parameters (fp32, {shard})", m.parameters),
        ("gradients (fp32)", m.gradients),
        ("optimizer state", m.optimizer),
        (f"activations (micro-batch {lay.micro_batch}, {ac}{', offloaded' if lay.act_offload else ''})",
         m.activations),
        ("temporary (loss/recompute, unsharded FSDP or autocast copies)", m.temporary),
        ("communication buffers", m.communication),
        ("runtime reserve", m.runtime),
    ]
    lines = [f"per-rank memory ({where}, the busiest):"]
    lines += [f"  {label:<64} {_gib(value):>7} GiB" for label, value in rows]
    if lay.cpu_offload:
        lines.append(f"  {'(in host memory instead: parameters, gradients, optimizer)':<64} "
                     f"{_gib(m.host_offload):>7} GiB")
    if m.host_activations:
        lines.append(f"  {'(in host memory: the offloaded activations in flight)':<64} "
                     f"{_gib(m.host_activations):>7} GiB")
    verdict = "fits" if c.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<64} {_gib(m.total):>7} GiB of {_gib(c.usable_bytes)} usable -> {verdict}")
    return lines


def _offload_label(layout: Layout) -> str:
    """The table's offload column: 'state' (parallel.cpu_offload), 'act' (activation offload), both, or 'no'."""
    kinds = [name for name, on in (("state", layout.cpu_offload), ("act", layout.act_offload)) if on]
    return "+".join(kinds) or "no"


def _cp_label(layout: Layout) -> str:
    if layout.cp == 1:
        return "1"
    if layout.cp_mode == "hybrid":
        return f"{layout.cp_ulysses}ux{layout.cp // layout.cp_ulysses}r"
    return f"{layout.cp}{'u' if layout.cp_mode == 'ulysses' else 'r'}"


def context_parallel_advice(plan: Plan) -> str | None:
    """A note when only layouts that split the sequence fit: 'this fits only with cp >= N'."""
    if plan.least_cp <= 1:
        return None
    return (f"note: at seq {plan.job.seq_len} this fits only with context parallelism, cp >= {plan.least_cp} "
            f"(parallel.cp_degree; docs/long_context.md)")


def format_table(ranked: list[Candidate]) -> list[str]:
    """The ranked layouts as a fixed-width table ('passes': accumulation steps or pipeline micro-batches)."""
    header = (f"{'#':>2}  {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3} {'cp':>6} {'ep':>3}  {'AC':<8} {'mb':>3} "
              f"{'passes':>6} "
              f"{'offload':>7}  {'mem/rank':>9}  {'tokens/s':>10}  {'MFU':>5}")
    lines = [header, "-" * len(header)]
    for i, c in enumerate(ranked, 1):
        lay = c.layout
        lines.append(
            f"{i:>2}  {lay.dp_replicate:>6} {lay.dp_shard:>8} {lay.tp:>3} {lay.pp:>3} {_cp_label(lay):>6} {lay.ep:>3}  "
            f"{_ac_label(lay):<8} {lay.micro_batch:>3} {lay.passes:>6} {_offload_label(lay):>7}  "
            f"{_gib(c.memory.total):>5} GiB  {c.step.tokens_per_s:>10,.0f}  {100 * c.step.mfu:>4.1f}%"
        )
    return lines


def _float8_peak(plan: Plan) -> str:
    """', 1979 TFLOP/s float8 (tensorwise linears)' when the job runs float8 (float8.enable); '' otherwise."""
    f = plan.job.float8
    if f is None:
        return ""
    if f.emulate:
        return ", float8 emulated (bf16 speed)"
    experts = f", {f.moe_recipe} experts" if f.moe_experts else ""
    return f", {plan.hw.peak_float8_flops / 1e12:.0f} TFLOP/s float8 ({f.recipe} linears{experts})"


def band_label() -> str:
    """The estimates' measured error band: '±11%' (the held-out published runs' median error, docs/planning.md)."""
    return f"±{100 * error_band():.0f}%"


def efficiency_origin(plan: Plan) -> str:
    """Where the plan's compute efficiency comes from: the calibration on published runs, or --efficiency."""
    if plan.efficiency == calibrated_efficiency(plan.hw.device_type):
        return f"calibrated on published runs, estimates {band_label()}"
    return "--efficiency"


def format_plan(plan: Plan) -> str:
    """The plan as text: model, cluster, the config's layout, then the ranked table."""
    a, hw = plan.job.args, plan.hw
    tokens = plan.global_batch * plan.job.seq_len
    ffn, experts = f"ffn {a.ffn_dim}", spec_of(a).experts
    if experts is not None and experts.n_moe_blocks(a):
        ffn = f"{experts.describe(a)}, {a.num_active_params() / 1e9:.2f}B active"
    lines = [
        f"model: {a.family} {a.flavor}, {a.num_params() / 1e9:.2f}B parameters (dim {a.dim}, {a.n_layers} layers, "
        f"{a.n_heads}/{a.n_kv_heads} heads, {ffn}, vocab {a.vocab_size}); seq {plan.job.seq_len}, "
        f"{plan.job.dtype}, {plan.job.optimizer}" + (f" ({plan.job.state_dtype} moments)"
                                                      if plan.job.state_dtype != "fp32" else ""),
        f"cluster: {plan.nodes} node(s) x {plan.devices_per_node} {hw.name} ({_gib(hw.memory_bytes)} GiB, "
        f"{hw.peak_flops / 1e12:.0f} TFLOP/s bf16{_float8_peak(plan)}; "
        f"{hw.intra_link} {hw.intra_node_bw / 1e9:.0f} GB/s, {hw.inter_link} {hw.inter_node_bw / 1e9:.0f} GB/s, "
        f"host {hw.host_link} {hw.host_bw / 1e9:.0f} GB/s; "
        f"compute at {100 * plan.efficiency:.1f}% of peak, {efficiency_origin(plan)})",
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
        lines.append(f"estimate: {s.tokens_per_s:,.0f} tokens/s ({band_label()}), MFU {100 * s.mfu:.1f}%, "
                     f"step {s.step_time:.2f}s "
                     f"(compute {s.compute:.2f}s, tp {s.tp_comm:.2f}s, pp {s.pp_comm + s.bubble:.2f}s, "
                     f"exposed fsdp {s.fsdp_exposed:.2f}s, offload {s.offload:.2f}s, ep all-to-all {s.ep_comm:.2f}s, "
                     f"cp {s.cp_comm:.2f}s" + (f", Muon gathers {s.optimizer_comm:.2f}s" if s.optimizer_comm else "")
                     + (f", activation offload {s.activation_offload:.2f}s exposed" if c.layout.act_offload else "")
                     + ")")
    else:
        lines.append(f"config layout does not apply to {plan.nodes * plan.devices_per_node} ranks: {plan.config_error}")
    lines.append("")
    if plan.ranked:
        lines.append(f"layouts that fit, fastest first (tokens/s {band_label()}):")
        lines += format_table(plan.ranked)
        lines += ["", "to use #1: " + config_overrides(plan.ranked[0].layout)]
    else:
        lines.append("no layout fits: use more devices, a shorter training.seq_len, or a smaller global batch")
    advice = context_parallel_advice(plan)
    if advice:
        lines.append(advice)
    return "\n".join(lines)

"""The planner checked against the real model: its exact per-rank bytes and every local shard shape next to what
the dry run measured on the parallelized model (`train.py --dry-run`, `titan-npu plan --verify`)."""

from __future__ import annotations

from titan_npu.config.schema import JobConfig
from titan_npu.planner.dry_run_result import DryRunResult
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.parameters import (
    adapter_local_shapes,
    is_expert_kind,
    local_shape,
    muon_gather_bytes,
    parameter_kind,
    parameter_kinds,
    rank_parameter_names,
    state_bytes,
    tensor_parallel_dims,
)


def compare_with_plan(result: DryRunResult, cfg: JobConfig) -> dict:
    """The planner's exact numbers for the same rank next to the dry run's; every shard shape is compared too."""
    job = job_from_config(cfg)
    layout = layout_from_config(cfg, result.world_size)
    planned = state_bytes(job, layout, result.rank)
    coords = layout.rank_coordinates(result.rank)
    kinds = parameter_kinds(job.args)
    tp_dims = tensor_parallel_dims(job.args)
    adapters = adapter_local_shapes(job, layout, result.rank)  # LoRA's, none without it
    expected_names = rank_parameter_names(job.args, layout, coords["pp"]) + list(adapters)
    problems = []
    missing = sorted(set(expected_names) - set(result.parameters))
    extra = sorted(set(result.parameters) - set(expected_names))
    if missing:
        problems.append(f"{len(missing)} parameters the plan expects are not on this rank (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} parameters on this rank the plan does not expect (e.g. {extra[0]})")
    for name in expected_names:
        if name not in result.parameters:
            continue
        kind = parameter_kind(name)
        want = list(adapters[name] if name in adapters else
                    local_shape(kinds[kind], tp_dims[kind], layout, coords, is_expert_kind(kind)))
        got = result.parameters[name]["local_shape"]
        if want != got:
            problems.append(f"{name}: local shard {got} but the plan expects {want}")
        grad = result.parameters[name].get("grad_local_shape")
        if grad is not None and grad != want:
            placements = ", ".join(result.parameters[name].get("grad_placements", [])) or "plain tensor"
            problems.append(f"{name}: gradient is {grad} ({placements}) but the parameter shard is {want}")
        grad_placements = result.parameters[name].get("grad_placements")
        if grad_placements is not None and grad_placements != result.parameters[name]["placements"]:
            # Same local shape, different layout (e.g. a pending Partial sum): the optimizer would redo that work.
            problems.append(f"{name}: gradient placements {grad_placements} differ from the parameter's "
                            f"{result.parameters[name]['placements']}")
    rows = [("parameters", planned.parameters, result.parameter_bytes),
            ("gradients", planned.gradients, result.gradient_bytes),
            ("optimizer", planned.optimizer, result.optimizer_bytes)]
    if job.optimizer == "muon":
        rows.append(("opt gather", muon_gather_bytes(job, layout, result.rank), result.optimizer_gather_bytes))
    for label, want_bytes, got_bytes in rows:
        if want_bytes != got_bytes:
            problems.append(f"{label}: dry run {got_bytes} bytes, plan {want_bytes} bytes")
    lines = ["plan vs dry run (bytes on this rank):"]
    lines += [f"  {label:<11} plan {want_bytes:>16,}  dry run {got_bytes:>16,}  "
              f"{'equal' if want_bytes == got_bytes else 'DIFFERENT'}" for label, want_bytes, got_bytes in rows]
    lines += [f"  mismatch: {p}" for p in problems[:10]]
    if len(problems) > 10:
        lines.append(f"  ... and {len(problems) - 10} more")
    lines.append("  every local shard matches the plan" if not problems else "  the plan and the model disagree")
    return {
        "match": not problems,
        "problems": problems,
        "planner": {label: want_bytes for label, want_bytes, _ in rows},
        "dry_run": {label: got_bytes for label, _, got_bytes in rows},
        "text": "\n".join(lines),
    }

"""validate_layout: every check that needs the parallel degrees, the model shapes and the run settings together.

Called by the Trainer right after the model arguments are resolved (before any model is built), and by the
planner, so an impossible layout is refused with the numbers and a fix before memory or time is spent.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from titan_npu.errors import LayoutError
from titan_npu.intmath import divisor_hint
from titan_npu.parallel import arithmetic
from titan_npu.parallel.degrees import Degrees

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig

PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")


def _listing(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:12]) + (" ..." if len(values) > 12 else "")


def pp_stages_per_rank(cfg: JobConfig) -> int:
    """Pipeline stages each pp rank runs: parallel.pp_virtual_stages, or 2 for Interleaved1F1B and 1 otherwise."""
    return arithmetic.stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages)


def pp_local_batch(cfg: JobConfig) -> int:
    """Sequences one pipeline runs per optimizer step: gradient accumulation becomes more microbatches under PP."""
    return arithmetic.local_batch(cfg.training.batch_size, cfg.training.gradient_accumulation_steps)


def pp_microbatches(cfg: JobConfig, dims: Degrees) -> int:
    """Microbatches per pipeline step: parallel.pp_microbatches, 0 = pp_degree * 2."""
    return arithmetic.microbatches(cfg.parallel.pp_microbatches, dims.pp)


def validate_layout(dims: Degrees, model_args: Any, cfg: JobConfig) -> None:
    """Refuse (LayoutError) a layout that cannot run this model with these settings; the message names the fix.

    dims: the job's Degrees (or the ParallelDims holding them); the degrees' own rules are Degrees'. model_args: any
    family's args (models/spec.py names the fields read here).
    """
    _check_data_parallel(dims, cfg)
    if dims.cp_enabled or cfg.parallel.cp_mode != "ring":
        _check_context_parallel(dims, model_args, cfg)
    if dims.tp_enabled:
        _check_tensor_parallel(dims, model_args, cfg)
    if dims.ep_enabled:
        _check_expert_parallel(dims, model_args)
    if dims.pp_enabled:
        _check_pipeline(dims, model_args, cfg)
    elif cfg.parallel.pp_virtual_stages > 1:
        raise LayoutError(
            f"parallel.pp_virtual_stages={cfg.parallel.pp_virtual_stages} needs pipeline parallelism "
            "(parallel.pp_degree > 1); set pp_virtual_stages = 0"
        )


def _check_data_parallel(dims: Degrees, cfg: JobConfig) -> None:
    p = cfg.parallel
    if p.cpu_offload and not dims.fsdp_enabled and dims.dp_mode != "hsdp":
        raise LayoutError(
            f"parallel.cpu_offload=true needs FSDP sharding, but this layout has {dims.describe()}; "
            "set parallel.fsdp=true with dp_shard > 1, or cpu_offload=false"
        )


def _check_context_parallel(dims: Degrees, a: Any, cfg: JobConfig) -> None:
    if dims.cp_enabled:
        check_context_parallel(dims.cp, cfg.parallel.cp_mode, dims.cp_ulysses, dims.tp, a, cfg)


def check_context_parallel(cp: int, cp_mode: str, cp_ulysses: int, tp: int, a: Any, cfg: JobConfig) -> None:
    """LayoutError when context parallelism over `cp` ranks (cp_mode, its Ulysses group size, beside tensor
    parallelism over `tp`) cannot split this model's heads or cfg's sequences; the planner asks it before it
    enumerates the other degrees of a (tp, cp) pair."""
    if cp_mode == "ulysses":
        _check_ulysses_heads(cp, a, tp)
    if cp_mode == "hybrid":
        _check_ulysses_heads(cp_ulysses, a, tp, "parallel.cp_ulysses_degree")
    seq_len = cfg.training.seq_len
    if seq_len % (2 * cp):
        raise LayoutError(
            f"training.seq_len={seq_len} does not split into 2 * parallel.cp_degree = {2 * cp} equal chunks (each "
            f"cp rank holds an early and a late chunk); use a seq_len that is a multiple of {2 * cp}"
        )
    if (seq_len // cp) % tp:
        multiple = math.lcm(2 * cp, cp * tp)
        raise LayoutError(
            f"training.seq_len={seq_len} leaves each cp rank {seq_len // cp} positions, which sequence parallelism "
            f"cannot split over parallel.tp_degree={tp}; use a seq_len that is a multiple of {multiple}"
        )
    if not cfg.parallel.fsdp:
        raise LayoutError(
            f"parallel.cp_degree={cp} with parallel.fsdp=false (the cp ranks shard the parameters with FSDP) is not "
            f"yet available; set parallel.fsdp = true or parallel.cp_degree = 1")


def _check_ulysses_heads(cp: int, a: Any, tp: int = 1, degree: str = "parallel.cp_degree") -> None:
    """Ulysses splits the heads over the cp ranks (`degree`: the cp ranks of a hybrid Ulysses group): query heads a
    multiple of cp, key/value heads a multiple of cp or a divisor of it (each then repeated for the cp / n_kv_heads
    ranks that read it); under tensor parallelism, the heads of one tp rank (n_heads / tp, n_kv_heads / tp)."""
    heads, kv_heads = a.n_heads // tp, a.n_kv_heads // tp
    if heads % cp or (kv_heads % cp and cp % kv_heads):
        choices = _listing([d for d in divisor_hint(heads) if d > 1 and not (kv_heads % d and d % kv_heads)])
        per_tp = f" ({heads} / {kv_heads} per rank of tp_degree={tp})" if tp > 1 else ""
        raise LayoutError(
            f"parallel.cp_mode=\"{'ulysses' if degree.endswith('cp_degree') else 'hybrid'}\" splits the attention "
            f"heads over {degree}={cp} ranks, but model.n_heads={a.n_heads} / n_kv_heads={a.n_kv_heads}{per_tp} do "
            f"not split {cp} ways (n_heads a multiple of {degree.split('.')[1]}, n_kv_heads a multiple or divisor of "
            f"it); choose {degree.split('.')[1]} from {choices or 'none'} or set parallel.cp_mode = \"ring\""
        )


def _check_expert_parallel(dims: Degrees, a: Any) -> None:
    ep = dims.ep
    n_experts = getattr(a, "n_experts", None)
    if not getattr(a, "n_moe_layers", 0):
        raise LayoutError(f"parallel.ep_degree={ep} splits the experts of a MoE model, but {a.family} {a.flavor} has "
                          f"no MoE layer; set parallel.ep_degree = 1")
    if n_experts % ep:
        raise LayoutError(f"parallel.ep_degree={ep} does not divide model.n_experts={n_experts}: each rank must hold "
                          f"as many whole experts; choose ep_degree from {_listing(divisor_hint(n_experts))}")
    not_yet = [(dims.tp_enabled and ep < dims.dp_shard,
                f"tensor parallelism (tp_degree={dims.tp}) and ep_degree < dp_shard={dims.dp_shard}",
                f"parallel.ep_degree = {dims.dp_shard} (the experts then need no FSDP)"),
               (dims.dp_replicate > 1 and ep < dims.dp_shard,
                f"dp_replicate={dims.dp_replicate} and ep_degree < dp_shard={dims.dp_shard}",
                f"parallel.ep_degree = {dims.dp_shard} (HSDP then shards the experts over the replicas)"),
               (not dims.fsdp, "parallel.fsdp=false", "parallel.fsdp = true")]
    for refused, what, fix in not_yet:
        if refused:
            raise LayoutError(f"parallel.ep_degree={ep} with {what} is not yet available; set {fix} or "
                              f"parallel.ep_degree = 1")


def _check_tensor_parallel(dims: Degrees, a: Any, cfg: JobConfig) -> None:
    tp = dims.tp
    # Degrees that split heads, kv heads and the FFN evenly (the vocabulary can always be padded).
    if a.n_heads % tp or a.n_kv_heads % tp or a.ffn_dim % tp:
        choices = _listing(divisor_hint(math.gcd(a.n_heads, a.n_kv_heads, a.ffn_dim)))
    if a.n_heads % tp:
        raise LayoutError(
            f"parallel.tp_degree={tp} does not divide model.n_heads={a.n_heads}: each rank must hold whole "
            f"attention heads (choose tp_degree from {choices})"
        )
    if a.n_kv_heads % tp:
        raise LayoutError(
            f"parallel.tp_degree={tp} does not divide model.n_kv_heads={a.n_kv_heads}: each rank must hold whole "
            f"key/value heads (choose tp_degree from {choices})"
        )
    if a.ffn_dim % tp:
        raise LayoutError(
            f"parallel.tp_degree={tp} does not divide the feed-forward size {a.ffn_dim}; choose tp_degree from "
            f"{choices} or set model.ffn_dim to a multiple of {tp}"
        )
    if a.vocab_size % tp:
        padded = math.ceil(a.vocab_size / tp) * tp
        raise LayoutError(
            f"model.vocab_size={a.vocab_size} is not divisible by parallel.tp_degree={tp} (the embedding and output "
            f"are split by vocabulary); pad it: set model.vocab_size = {padded} (token ids stay below "
            f"{a.vocab_size}, the {padded - a.vocab_size} extra rows are never used)"
        )
    if cfg.training.seq_len % tp:
        raise LayoutError(
            f"training.seq_len={cfg.training.seq_len} is not divisible by parallel.tp_degree={tp} (sequence "
            f"parallelism splits each sequence across the tp ranks); use a seq_len that is a multiple of {tp}"
        )
    if getattr(a, "n_moe_layers", 0):
        _check_moe_tensor_parallel(tp, a)


def _check_moe_tensor_parallel(tp: int, a: Any) -> None:
    """Tensor parallelism of MoE layers splits each expert's ffn dim, and the shared expert's."""
    if a.moe_ffn_dim % tp:
        raise LayoutError(
            f"parallel.tp_degree={tp} does not divide model.moe_ffn_dim={a.moe_ffn_dim} (each expert is split on "
            f"its ffn dim over the tp ranks); choose tp_degree from {_listing(divisor_hint(a.moe_ffn_dim))}"
        )
    if getattr(a, "shared_ffn_dim", 0) % tp:
        raise LayoutError(
            f"parallel.tp_degree={tp} does not divide model.shared_ffn_dim={a.shared_ffn_dim} (the shared expert is "
            f"split on its ffn dim over the tp ranks); choose tp_degree from "
            f"{_listing(divisor_hint(a.shared_ffn_dim))}"
        )


def _check_pipeline(dims: Degrees, a: Any, cfg: JobConfig) -> None:
    p = cfg.parallel
    schedule = p.pp_schedule
    if schedule not in PP_SCHEDULES:
        raise LayoutError(f"parallel.pp_schedule={schedule!r} is unknown (choose {', '.join(PP_SCHEDULES)})")
    per_rank = pp_stages_per_rank(cfg)
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise LayoutError(
            f"parallel.pp_schedule={schedule} runs one stage per rank, but pp_virtual_stages={per_rank}; "
            "set pp_schedule = \"Interleaved1F1B\" or pp_virtual_stages = 0"
        )
    if schedule in arithmetic.LOOPED_SCHEDULES and per_rank < 2:
        raise LayoutError(
            f"parallel.pp_schedule={schedule} needs at least 2 stages per rank; set pp_virtual_stages = 0 "
            "(2) or more, or use 1F1B"
        )
    if schedule in arithmetic.V_SCHEDULES:
        _check_v_schedule(dims, a, cfg)
    if getattr(a, "tie_embeddings", False):
        raise LayoutError(
            f"{a.family} {a.flavor} ties its output projection to the embedding, which pipeline parallelism would "
            f"place on different ranks; set model.tie_embeddings=false (separate matrices) or parallel.pp_degree=1"
        )
    stages = dims.pp * per_rank
    if a.n_layers < stages:
        raise LayoutError(
            f"model.n_layers={a.n_layers} is fewer than the {stages} pipeline stages (pp_degree={dims.pp} x "
            f"{per_rank} per rank); every stage needs a layer: lower pp_degree / pp_virtual_stages to at most "
            f"{a.n_layers} stages"
        )
    n_mb = pp_microbatches(cfg, dims)
    local = pp_local_batch(cfg)
    origin = f"parallel.pp_microbatches={p.pp_microbatches}" + (f" (= pp_degree x 2 = {n_mb})"
                                                                   if not p.pp_microbatches else "")
    if n_mb < dims.pp:
        raise LayoutError(
            f"{origin} is fewer than the pp_degree={dims.pp} pipeline ranks, so some stages would idle every "
            f"step; set parallel.pp_microbatches >= {dims.pp}"
        )
    if local % n_mb:
        fits = [d for d in divisor_hint(local) if d >= dims.pp]
        fix = f"set parallel.pp_microbatches to one of {_listing(fits)}, or " if fits else ""
        raise LayoutError(
            f"{origin} does not divide the {local} sequences each pipeline runs per step (training.batch_size="
            f"{cfg.training.batch_size} x gradient_accumulation_steps={cfg.training.gradient_accumulation_steps}; "
            f"under pipeline parallelism the accumulation steps become microbatches); {fix}make "
            f"batch_size x gradient_accumulation_steps a multiple of {n_mb}"
        )
    if schedule in arithmetic.V_SCHEDULES and n_mb < arithmetic.v_min_microbatches(schedule, dims.pp):
        need = arithmetic.v_min_microbatches(schedule, dims.pp)
        why = "one per stage of the V" if schedule == "DualPipeV" else "2 x pp_degree - 1, to fill the V"
        raise LayoutError(
            f"{origin} is fewer than the {need} microbatches {schedule} needs at pp_degree={dims.pp} ({why}); set "
            f"parallel.pp_microbatches >= {need}"
        )
    if schedule in arithmetic.LOOPED_SCHEDULES:
        rounds = max(1, n_mb // dims.pp)
        if n_mb % rounds:
            raise LayoutError(
                f"{origin}: {schedule} needs the microbatch count to be a multiple of "
                f"max(1, microbatches // pp_degree) = {rounds}; use a multiple of pp_degree={dims.pp}"
            )
    if cfg.training.dtype == "fp16":
        raise LayoutError(
            "training.dtype=fp16 needs loss scaling, which the pipeline schedules do not run; use bf16 with "
            "pipeline parallelism"
        )
    if cfg.validation.enable:
        raise LayoutError(
            "validation.enable=true is not available with pipeline parallelism (a pipeline rank holds only some "
            "layers); set validation.enable=false or parallel.pp_degree=1"
        )


def _check_v_schedule(dims: Degrees, a: Any, cfg: JobConfig) -> None:
    """ZBVZeroBubble / DualPipeV: two stages per rank in a V, each of at least one layer (unequal stages are split
    as arithmetic.leftover_stages says), and a split input/weight backward."""
    schedule, virtual = cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages
    if virtual not in (0, 2):
        raise LayoutError(
            f"parallel.pp_schedule={schedule} runs exactly 2 stages per rank (placed in a V), but "
            f"pp_virtual_stages={virtual}; set pp_virtual_stages = 0 (or 2), or use Interleaved1F1B for {virtual}"
        )
    stages = 2 * dims.pp
    if a.n_layers < stages:
        most = a.n_layers // 2
        fix = f"set parallel.pp_degree to at most {most}, or " if most >= 2 else ""
        raise LayoutError(
            f"model.n_layers={a.n_layers} is fewer than the {stages} stages of {schedule} at pp_degree={dims.pp} "
            f"(2 per rank, placed in a V; every stage needs a layer); {fix}use 1F1B"
        )
    if cfg.compile.enable:
        raise LayoutError(
            f"compile.enable=true is not available with parallel.pp_schedule={schedule}: torch's split input/weight "
            "backward, which the schedule runs, does not take compiled stages; set compile.enable=false or use "
            "1F1B / Interleaved1F1B"
        )

"""Section-local checks of a JobConfig, with the fix in every message; also normalises spellings (bfloat16 -> bf16).

Checks that need the resolved model or the world size (seq_len vs max_seq_len, tp vs heads) belong to the
model and parallel code, which know those values.
"""

from __future__ import annotations

import re

from titan_npu.config.aliases import normalize_flavor
from titan_npu.config.coerce import coerce, field_types, section_types, show
from titan_npu.config.schema import JobConfig, ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.models.registry import family_names, parse_model_name

DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}
DECAY_TYPES = ("cosine", "linear", "constant", "wsd")
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
AC_MODES = ("none", "selective", "full")
BACKENDS = ("auto", "hccl", "nccl", "gloo")
CP_MODES = ("ring", "ulysses", "hybrid")  # parallel/layout.py says which of them run yet
OPTIMIZERS = ("AdamW", "Adam", "SGD")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
PROGRESS_STYLES = ("auto", "bar", "lines")
PROFILER_LEVELS = ("Level0", "Level1", "Level2")
ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient")
FLOAT8_RECIPES = ("tensorwise", "rowwise")

# Model sizes that must be positive when given; None means "take the flavor's value".
_POSITIVE_MODEL_FIELDS = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "ffn_dim_multiplier",
    "multiple_of", "norm_eps", "rope_theta", "max_seq_len",
)


def fail(key: str, message: str) -> ConfigError:
    """A ConfigError that remembers which key it is about, so the loader can name the file or flag that set it."""
    error = ConfigError(message)
    error.key = key  # type: ignore[attr-defined]
    return error


def validate(cfg: JobConfig) -> JobConfig:
    """Check every section of `cfg` in place (types coerced, names normalised); return it or raise ConfigError."""
    _coerce_types(cfg)
    _check_model(cfg.model)
    _check_training(cfg)
    _check_optimizer(cfg)
    _check_lr_scheduler(cfg)
    _check_parallel(cfg)
    _check_checkpoint(cfg)
    _check_float8(cfg)
    _check_rest(cfg)
    return cfg


def _coerce_types(cfg: JobConfig) -> None:
    """Configs built in code get the same type rules as files ('64' -> 64, 2.5 for an int refused)."""
    for section in section_types():
        obj = getattr(cfg, section)
        for key, hint in field_types(section).items():
            setattr(obj, key, coerce(getattr(obj, key), hint, f"{section}.{key}"))


def _choice(key: str, value: str, choices: tuple[str, ...], what: str) -> str:
    """`value` matched case-insensitively against `choices`, returned in the canonical spelling."""
    for choice in choices:
        if value.strip().lower() == choice.lower():
            return choice
    raise fail(key, f"{key} = {show(value)} is not a known {what} (use {_or(choices)})")


def _or(choices: tuple[str, ...] | list[str]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def _at_least(key: str, value: float, low: float, why: str) -> None:
    if value < low:
        raise fail(key, f"{key} = {show(value)} must be >= {low:g} ({why})")


def _check_model(m: ModelConfig) -> None:
    family, size = parse_model_name(m.name)
    if family is None:
        raise fail(
            "model.name",
            f"model.name = {show(m.name)} is not a known model (use {', '.join(family_names())}, or a name with the "
            f"size such as llama2_7b, llama3_8b or qwen3_8b)",
        )
    m.name = family
    m.attention_backend = _choice("model.attention_backend", m.attention_backend, ATTENTION_BACKENDS,
                                  "attention kernel")
    # A sized name set in code picks its flavor unless a flavor other than the default was chosen.
    if size is not None and m.flavor == ModelConfig.flavor:
        m.flavor = size
    if not m.flavor.strip():
        raise fail("model.flavor", "model.flavor is empty (use a size such as 7B, 8B, 13B, 70B, or debug)")
    m.flavor = normalize_flavor(m.flavor)
    for key in _POSITIVE_MODEL_FIELDS:
        value = getattr(m, key)
        if value is not None and value <= 0:
            raise fail(
                f"model.{key}",
                f"model.{key} = {show(value)} must be > 0 when given (leave it out to take the flavor's value)",
            )
    if m.rope_scaling_factor is not None and m.rope_scaling_factor < 0:
        raise fail(
            "model.rope_scaling_factor",
            f"model.rope_scaling_factor = {show(m.rope_scaling_factor)} must be >= 0 (0 or unset turns it off)",
        )
    if m.n_heads is not None and m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        divisors = [str(d) for d in range(1, m.n_heads + 1) if m.n_heads % d == 0]
        raise fail(
            "model.n_kv_heads",
            f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads} "
            f"(query heads are shared evenly by the kv heads; use {_or(divisors)})",
        )
    if m.dim is not None and m.n_heads is not None and m.dim % m.n_heads:
        raise fail(
            "model.dim",
            f"model.dim = {m.dim} must be a multiple of model.n_heads = {m.n_heads} (each head gets dim / n_heads)",
        )


def _check_training(cfg: JobConfig) -> None:
    t = cfg.training
    for key, why in (
        ("batch_size", "sequences per device per micro-step"),
        ("seq_len", "tokens per sequence"),
        ("gradient_accumulation_steps", "1 = no accumulation"),
        ("max_steps", "optimizer steps to run"),
    ):
        _at_least(f"training.{key}", getattr(t, key), 1, why)
    dtype = DTYPES.get(t.dtype.strip().lower())
    if dtype is None:
        raise fail("training.dtype", f"training.dtype = {show(t.dtype)} is not a known dtype (use bf16, fp16 or fp32)")
    t.dtype = dtype
    _at_least("training.max_norm", t.max_norm, 0, "the gradient-norm clipping threshold")
    _at_least("training.loss_chunk_tokens", t.loss_chunk_tokens, 0, "0 computes the whole logits at once")
    if not 0 <= t.memory_fraction <= 1:
        raise fail(
            "training.memory_fraction",
            f"training.memory_fraction = {show(t.memory_fraction)} must be in [0, 1] "
            f"(a share of device memory; 0 = no cap)",
        )


def _check_optimizer(cfg: JobConfig) -> None:
    o = cfg.optimizer
    o.name = _choice("optimizer.name", o.name, OPTIMIZERS, "optimizer")
    o.implementation = _choice(
        "optimizer.implementation", o.implementation, OPTIMIZER_IMPLEMENTATIONS, "optimizer implementation"
    )
    if o.lr <= 0:
        raise fail("optimizer.lr", f"optimizer.lr = {show(o.lr)} must be > 0 (a typical peak learning rate is 3e-4)")
    _at_least("optimizer.weight_decay", o.weight_decay, 0, "0 turns weight decay off; 0.1 is typical")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise fail(
            "optimizer.betas",
            f"optimizer.betas = {show(o.betas)} must be two values in [0, 1) (the usual choice is [0.9, 0.95])",
        )
    if o.eps <= 0:
        raise fail("optimizer.eps", f"optimizer.eps = {show(o.eps)} must be > 0 (1e-8 is usual)")


def _check_lr_scheduler(cfg: JobConfig) -> None:
    s = cfg.lr_scheduler
    _at_least("lr_scheduler.warmup_steps", s.warmup_steps, 0, "0 = no warmup")
    s.decay_type = _choice("lr_scheduler.decay_type", s.decay_type, DECAY_TYPES, "decay type")
    for key in ("min_lr_ratio", "decay_ratio"):
        value = getattr(s, key)
        if not 0 <= value <= 1:
            raise fail(f"lr_scheduler.{key}", f"lr_scheduler.{key} = {show(value)} must be in [0, 1] (a fraction)")


def _check_parallel(cfg: JobConfig) -> None:
    p = cfg.parallel
    p.backend = _choice("parallel.backend", p.backend, BACKENDS, "backend")
    for key in ("dp_replicate", "tp_degree", "pp_degree", "cp_degree", "cp_ulysses_degree", "ep_degree"):
        _at_least(f"parallel.{key}", getattr(p, key), 1, "1 = this dimension is not split")
    p.cp_mode = _choice("parallel.cp_mode", p.cp_mode, CP_MODES, "context parallel mode")
    if p.dp_shard != -1 and p.dp_shard < 1:
        raise fail(
            "parallel.dp_shard", f"parallel.dp_shard = {p.dp_shard} must be -1 (all remaining ranks) or >= 1"
        )
    p.pp_schedule = _choice("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES, "pipeline schedule")
    _at_least("parallel.pp_microbatches", p.pp_microbatches, 0, "0 = pp_degree * 2")
    _at_least("parallel.pp_virtual_stages", p.pp_virtual_stages, 0, "0 = 2 for Interleaved1F1B, else 1")
    ac = cfg.activation_checkpoint
    ac.mode = _choice("activation_checkpoint.mode", ac.mode, AC_MODES, "activation checkpointing mode")
    _at_least("activation_checkpoint.selective_every", ac.selective_every, 1, "1 = every block")
    if not cfg.compile.backend.strip():
        raise fail("compile.backend", "compile.backend is empty (inductor is the usual torch.compile backend)")


def _check_float8(cfg: JobConfig) -> None:
    f = cfg.float8
    f.recipe = _choice("float8.recipe", f.recipe, FLOAT8_RECIPES, "float8 recipe")
    if any(not name.strip() for name in f.filter_fqns):
        raise fail("float8.filter_fqns", f"float8.filter_fqns = {show(f.filter_fqns)} holds an empty name, which "
                   "would match every linear (give module names such as output or attention.wq)")
    if f.moe_experts:
        raise fail("float8.moe_experts", "float8.moe_experts = true: the MoE routed experts' grouped GEMMs stay in the "
                   "training dtype in this version (torchao 0.18 has float8 grouped GEMMs only as a CUDA sm90+ "
                   "prototype, not wired in); set it to false (the other linears, shared experts included, convert)")


_NEGATIVE_STEP = re.compile(r"-\d+")


def _check_checkpoint(cfg: JobConfig) -> None:
    c = cfg.checkpoint
    _at_least("checkpoint.keep_last_n", c.keep_last_n, 1, "how many recent checkpoints stay on disk")
    _at_least("checkpoint.save_interval", c.save_interval, 1, "steps between checkpoints")
    resume = c.resume.strip()
    if resume.lower() in ("auto", "never"):
        resume = resume.lower()
    if not resume or _NEGATIVE_STEP.fullmatch(resume):
        raise fail(
            "checkpoint.resume",
            f"checkpoint.resume = {show(c.resume)} must be auto, never, a step number or a checkpoint path",
        )
    c.resume = resume
    dtype = DTYPES.get(c.export_dtype.strip().lower())
    if dtype is None:
        raise fail(
            "checkpoint.export_dtype",
            f"checkpoint.export_dtype = {show(c.export_dtype)} is not a dtype (use bf16, fp16 or fp32)",
        )
    c.export_dtype = dtype
    if not c.dir.strip():
        raise fail("checkpoint.dir", "checkpoint.dir is empty (give a directory, e.g. checkpoints)")


def _check_rest(cfg: JobConfig) -> None:
    d = cfg.data
    _at_least("data.num_workers", d.num_workers, 0, "0 = load in the training process")
    if not d.tokenizer.strip():
        raise fail("data.tokenizer", "data.tokenizer is empty (use byte, a tokenizer.json/.model or its directory)")
    if not 0 <= d.val_fraction < 1:
        raise fail("data.val_fraction", f"data.val_fraction = {show(d.val_fraction)} must be in [0, 1)")
    _check_document_mask(cfg)

    m = cfg.metrics
    _at_least("metrics.log_interval", m.log_interval, 1, "steps between log lines")
    _at_least("metrics.peak_tflops", m.peak_tflops, 0, "0 = detect from the device")
    m.progress = _choice("metrics.progress", m.progress, PROGRESS_STYLES, "progress style")
    _at_least("metrics.spike_sigma", m.spike_sigma, 0, "standard deviations above the recent loss; 4 is usual")
    _at_least("metrics.spike_window", m.spike_window, 1, "steps of recent loss the spike check looks at")

    v = cfg.validation
    _at_least("validation.interval", v.interval, 1, "steps between validations")
    _at_least("validation.steps", v.steps, 1, "batches per validation")

    pr = cfg.profiling
    _at_least("profiling.start_step", pr.start_step, 0, "the step the trace starts at")
    _at_least("profiling.active_steps", pr.active_steps, 1, "steps recorded in the trace")
    if pr.ranks != [-1] and any(rank < 0 for rank in pr.ranks):
        raise fail(
            "profiling.ranks",
            f"profiling.ranks = {show(pr.ranks)} holds a negative rank (ranks count from 0; [] or [-1] = every rank)",
        )
    pr.level = _choice("profiling.level", pr.level, PROFILER_LEVELS, "profiler level")

    co = cfg.comm
    _at_least("comm.init_timeout_s", co.init_timeout_s, 1, "seconds to wait for all ranks to join")
    _at_least("comm.join_timeout_s", co.join_timeout_s, 1, "seconds every rank has to reach the process group")
    _at_least("comm.timeout_s", co.timeout_s, 1, "seconds a collective may take")
    _at_least("comm.hccl_buffsize_mb", co.hccl_buffsize_mb, 0, "0 = keep HCCL_BUFFSIZE from the environment")
    if not 0 <= co.hccl_if_base_port <= 65535:
        raise fail(
            "comm.hccl_if_base_port",
            f"comm.hccl_if_base_port = {co.hccl_if_base_port} is not a port "
            f"(use 1-65535, or 0 to keep the environment's)",
        )



def _check_document_mask(cfg: JobConfig) -> None:
    d = cfg.data
    if d.reset_position_ids and not d.document_mask:
        raise fail("data.reset_position_ids", "data.reset_position_ids = true restarts positions at document "
                   "starts, which needs data.document_mask = true; set both or neither")


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """ConfigError when training.seq_len exceeds the model's max_seq_len (known once the model's shapes are)."""
    if seq_len > max_seq_len:
        raise ConfigError(f"training.seq_len={seq_len} exceeds model.max_seq_len={max_seq_len}; lower training.seq_len "
                          "or raise model.max_seq_len")

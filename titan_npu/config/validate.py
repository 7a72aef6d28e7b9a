"""Section-local checks of a JobConfig, with the fix in every message; also normalises spellings (bfloat16 -> bf16).

Checks that need the resolved model or the world size (seq_len vs max_seq_len, tp vs heads) belong to the
model and parallel code, which know those values.
"""

from __future__ import annotations

import re

from titan_npu.config.aliases import normalize_flavor
from titan_npu.config.coerce import coerce, field_types, key_types, section_types, show
from titan_npu.config.mixture import check_sources
from titan_npu.config.options import CONFIG_KEYS, family_key_rows
from titan_npu.config.schema import JobConfig, ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.intmath import divisor_hint
from titan_npu.knobs import option_error, or_list

DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


def fail(key: str, message: str) -> ConfigError:
    """A ConfigError that remembers which key it is about, so the loader can name the file or flag that set it."""
    return option_error(key, message)


def validate(cfg: JobConfig, model: bool = True) -> JobConfig:
    """Check every section of `cfg` in place (types coerced, names normalised); return it or raise ConfigError.
    model=False leaves [model] unchecked (the model registry it needs imports torch)."""
    _coerce_types(cfg)
    _check_table(cfg)
    if model:
        _check_model(cfg.model)
    _check_training(cfg)
    _check_optimizer(cfg)
    _check_activation_offload(cfg)
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


def _check_table(cfg: JobConfig) -> None:
    """Every key's range or choices from the one table (options.py); choices come back in their canonical spelling."""
    for name, knob in CONFIG_KEYS.items():
        section, key = name.split(".", 1)
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        setattr(obj, key, knob.check(name, value))


def _check_model(m: ModelConfig) -> None:
    from titan_npu.models.registry import family_names, parse_model_name

    family, size = parse_model_name(m.name)
    if family is None:
        raise fail(
            "model.name",
            f"model.name = {show(m.name)} is not a known model (use {', '.join(family_names())}, or a name with the "
            f"size such as llama2_7b, llama3_8b or qwen3_8b)",
        )
    m.name = family
    # A sized name set in code picks its flavor unless a flavor other than the default was chosen.
    if size is not None and m.flavor == ModelConfig.flavor:
        m.flavor = size
    if not m.flavor.strip():
        raise fail("model.flavor", "model.flavor is empty (use a size such as 7B, 8B, 13B, 70B, or debug)")
    m.flavor = normalize_flavor(m.flavor)
    _check_family_keys(m)
    if m.n_heads is not None and m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        divisors = [str(d) for d in divisor_hint(m.n_heads)]
        raise fail(
            "model.n_kv_heads",
            f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads} "
            f"(query heads are shared evenly by the kv heads; use {or_list(divisors)})",
        )
    if m.dim is not None and m.n_heads is not None and m.dim % m.n_heads:
        raise fail(
            "model.dim",
            f"model.dim = {m.dim} must be a multiple of model.n_heads = {m.n_heads} (each head gets dim / n_heads)",
        )


def _check_family_keys(m: ModelConfig) -> None:
    """Each of [model]'s own keys is one of its family's (models/<family>/: ModelSpec.model_keys), typed and in the
    range the family declares; another family's key is refused naming the family and its keys."""
    rows = family_key_rows(m.name)
    types_ = key_types("model")
    for key, value in list(m.keys.items()):
        name = f"model.{key}"
        if name not in rows:
            own = ", ".join(name.split(".", 1)[1] for name in rows)
            raise fail(name, f"{name} is not a key of the {m.name} family; its keys: {own} (see docs/config.md)")
        setattr(m, key, rows[name].check(name, coerce(value, types_[key], name)))


def _check_training(cfg: JobConfig) -> None:
    t = cfg.training
    dtype = DTYPES.get(t.dtype.strip().lower())
    if dtype is None:
        raise fail("training.dtype", f"training.dtype = {show(t.dtype)} is not a known dtype (use bf16, fp16 or fp32)")
    t.dtype = dtype


def _check_optimizer(cfg: JobConfig) -> None:
    o = cfg.optimizer
    if len(o.betas) != 2:
        raise fail(
            "optimizer.betas",
            f"optimizer.betas = {show(o.betas)} must be two values in [0, 1) (the usual choice is [0.9, 0.95])",
        )
    if len(o.muon_ns_coefficients) != 3:
        raise fail("optimizer.muon_ns_coefficients",
                   f"optimizer.muon_ns_coefficients = {show(o.muon_ns_coefficients)} must be three numbers a, b, c "
                   f"(the quintic's; [3.4445, -4.775, 2.0315] is usual)")
    if o.state_dtype == "bf16" and cfg.training.dtype == "fp16":
        raise fail("optimizer.state_dtype", "optimizer.state_dtype = 'bf16' with training.dtype = 'fp16': fp16 "
                   "training is for devices without bf16 arithmetic, which bf16 moments need; keep "
                   "optimizer.state_dtype = 'fp32' with fp16, or train in training.dtype = 'bf16'")
    if o.state_dtype != "fp32" and o.name == "SGD":
        raise fail("optimizer.state_dtype", f"optimizer.state_dtype = {show(o.state_dtype)} applies to Adam's "
                   "moments (AdamW, Adam, and Muon's AdamW part); SGD keeps its momentum in the parameters' dtype: "
                   "set optimizer.state_dtype = 'fp32' or choose AdamW")


def _check_activation_offload(cfg: JobConfig) -> None:
    a = cfg.activation_checkpoint
    if not a.offload:
        return
    if a.mode == "full" or (a.mode == "selective" and a.selective_ops):
        how = "mode = 'full'" if a.mode == "full" else "selective_ops = true"
        raise fail("activation_checkpoint.offload", f"activation_checkpoint.offload = true with {how}: every block "
                   "is recomputed, so no block keeps activations to offload; use mode = 'none', or 'selective' with "
                   "selective_every (the blocks it does not recompute are offloaded), or set offload = false")
    if cfg.compile.enable:
        raise fail("activation_checkpoint.offload", "activation_checkpoint.offload = true with compile.enable = true: "
                   "the offload hooks wrap each block's eager forward, which compile replaces; turn one of them off")


def _check_float8(cfg: JobConfig) -> None:
    f = cfg.float8
    if any(not name.strip() for name in f.filter_fqns):
        raise fail("float8.filter_fqns", f"float8.filter_fqns = {show(f.filter_fqns)} holds an empty name, which "
                   "would match every linear (give module names such as output or attention.wq)")
    if f.moe_experts and not f.enable:
        raise fail("float8.moe_experts", "float8.moe_experts = true converts the MoE experts along with the linears; "
                   "set float8.enable = true too")
    if f.enable and f.moe_experts and f.emulate and f.moe_recipe == "rowwise":
        raise fail("float8.moe_experts", "float8.moe_recipe = 'rowwise' with float8.emulate = true: torchao has "
                   "no emulation of its rowwise float8 grouped GEMM (Triton casts and "
                   "torch._scaled_grouped_mm, CUDA only); emulate float8.moe_recipe = 'mxfp8' instead")
    if f.enable and f.moe_experts and cfg.training.dtype == "fp16":
        raise fail("float8.moe_experts", "float8.moe_experts = true with training.dtype = 'fp16': torchao's float8 "
                   "grouped GEMMs take fp32 or bf16 operands; use training.dtype = 'bf16'")


_NEGATIVE_STEP = re.compile(r"-\d+")


def _check_checkpoint(cfg: JobConfig) -> None:
    c = cfg.checkpoint
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


def _check_rest(cfg: JobConfig) -> None:
    check_sources(cfg.data)
    _check_document_mask(cfg)
    _check_fault_tolerance(cfg)
    _check_lora(cfg)


def _check_fault_tolerance(cfg: JobConfig) -> None:
    f = cfg.fault_tolerance
    if not f.enable:
        return
    if f.replica_id >= f.num_replica_groups:
        last = f.num_replica_groups - 1
        raise fail("fault_tolerance.replica_id", f"fault_tolerance.replica_id = {f.replica_id} is outside "
                   f"num_replica_groups = {f.num_replica_groups}; give each group an id in 0..{last}")
    if f.min_replicas > f.num_replica_groups:
        raise fail("fault_tolerance.min_replicas", f"fault_tolerance.min_replicas = {f.min_replicas} is more than "
                   f"num_replica_groups = {f.num_replica_groups}; no step could commit, lower it")
    if cfg.parallel.dp_replicate != 1:
        raise fail("parallel.dp_replicate", f"parallel.dp_replicate = {cfg.parallel.dp_replicate} with "
                   "fault_tolerance.enable: the replicas are the replica groups (one torchrun each); set "
                   "parallel.dp_replicate = 1 and fault_tolerance.num_replica_groups to the replica count")


def _check_lora(cfg: JobConfig) -> None:
    lora = cfg.lora
    if not lora.enable:
        return
    if not lora.target_modules or any(not str(p).strip() for p in lora.target_modules):
        raise fail("lora.target_modules", f"lora.target_modules = {show(lora.target_modules)} is empty or holds an "
                   "empty pattern; name modules such as [\"wq\", \"wv\"] (or leave the key out for the defaults)")
    if lora.experts:
        raise fail("lora.experts", "lora.experts = true: adapters on the MoE routed experts are not supported; set "
                   "lora.experts = false (attention, dense MLPs and shared experts take adapters)")
    if cfg.float8.enable:
        raise fail("lora.enable", "lora.enable = true with float8.enable = true: float8 linears take no adapters; "
                   "turn one of them off")


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

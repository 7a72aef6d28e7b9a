"""Llama model arguments: the flavor presets (Meta's published shapes) and their resolution from the config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from titan_npu.config.aliases import split_model_name
from titan_npu.config.schema import ModelConfig
from titan_npu.errors import ConfigError

# Llama 3.1 RoPE frequency scaling constants (Meta's apply_scaling); only the factor is configurable.
ROPE_SCALING_LOW_FREQ_FACTOR = 1.0
ROPE_SCALING_HIGH_FREQ_FACTOR = 4.0
ROPE_SCALING_ORIGINAL_CONTEXT = 8192

# Preset fields use the names of config.schema.ModelConfig; the SwiGLU hidden size follows Meta's rule
# (ffn_hidden_dim) from dim, ffn_dim_multiplier and multiple_of unless ffn_dim is given explicitly. Presets
# without n_kv_heads are multi-head attention: n_kv_heads follows n_heads, also when n_heads is overridden.
_LLAMA2_7B = dict(dim=4096, n_layers=32, n_heads=32, multiple_of=256, ffn_dim_multiplier=None)
FLAVORS: dict[str, dict[str, dict[str, Any]]] = {
    "llama2": {
        "debug": dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=2048),
        "7B": dict(_LLAMA2_7B, vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
        "13B": dict(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256,
                    ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
        "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, multiple_of=4096,
                    ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
    },
    "llama3": {
        "debug": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=2048),
        # Llama 3.2 1B shapes; its embedding and output are separate matrices here (Meta ties them): 1.50B params.
        "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                   ffn_dim_multiplier=1.5, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
        # Llama 2 7B shapes (multi-head attention, FFN 11008) with Llama 3's vocabulary and RoPE base.
        "7B": dict(_LLAMA2_7B, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
        "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                   ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
        "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                    ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
        "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                     ffn_dim_multiplier=1.2, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
    },
}

# ModelConfig fields that override a preset when set (not None).
_OVERRIDABLE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "ffn_dim_multiplier",
                "multiple_of", "norm_eps", "rope_theta", "rope_scaling_factor", "max_seq_len")


@dataclass
class LlamaArgs:
    """Resolved shapes and hyperparameters of one Llama model."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (multi-head attention)
    vocab_size: int = 32000
    ffn_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float | None = None  # Llama 3.1 frequency scaling; None = off
    max_seq_len: int = 4096
    use_flash_attention: bool = True
    family: str = "llama2"
    flavor: str = "custom"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _validate(self)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.n_heads

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Exact parameter count from the shapes; exclude_embedding drops tok_embeddings (a lookup, no FLOPs)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim  # wq, wo + wk, wv
        feed_forward = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        per_layer = attention + feed_forward + 2 * self.dim  # + attention_norm, ffn_norm
        embedding = self.vocab_size * self.dim
        total = embedding + self.n_layers * per_layer + self.dim + self.vocab_size * self.dim  # + norm, output
        return total - embedding if exclude_embedding else total

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), PaLM's convention: 6 N + 12 L H D S (no causal halving)."""
        return 6 * self.num_params(exclude_embedding=True) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's SwiGLU hidden size: 2/3 of 4*dim, times the multiplier, rounded up to a multiple of multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def build_model_args(model_cfg: ModelConfig) -> LlamaArgs:
    """Resolve [model] into LlamaArgs: the family's flavor preset, then every explicit (non-None) field on top."""
    family, size = split_model_name(model_cfg.name)
    if family is None:
        raise ConfigError(
            f"model.name='{model_cfg.name}' is not a known model (valid: llama2, llama3, optionally with a size like "
            f"llama3_8b)"
        )
    size_in_name = None if size is None else _canonical_flavor(family, size)
    flavor = _canonical_flavor(family, model_cfg.flavor or "debug")
    if size_in_name is not None:
        # A size in the name (llama2_13b) selects the flavor; only a different explicit size conflicts with it.
        if flavor not in ("debug", size_in_name):
            raise ConfigError(
                f"model.name='{model_cfg.name}' says {size_in_name} but model.flavor='{model_cfg.flavor}'; "
                f"drop the size from the name or set flavor = \"{size_in_name}\""
            )
        flavor = size_in_name
    fields: dict[str, Any] = dict(FLAVORS[family][flavor])
    fields.update({k: getattr(model_cfg, k) for k in _OVERRIDABLE if getattr(model_cfg, k) is not None})
    _check_positive(fields)
    ffn_dim = fields.pop("ffn_dim", None)
    multiple_of = fields.pop("multiple_of")
    multiplier = fields.pop("ffn_dim_multiplier")
    if ffn_dim is None:
        ffn_dim = ffn_hidden_dim(fields["dim"], multiple_of, multiplier)
    # 0 means off, as None does.
    fields["rope_scaling_factor"] = fields.get("rope_scaling_factor") or None
    return LlamaArgs(
        **fields,
        ffn_dim=ffn_dim,
        use_flash_attention=bool(model_cfg.use_flash_attention),
        family=family,
        flavor=flavor,
    )


def _canonical_flavor(family: str, flavor: str) -> str:
    for known in FLAVORS[family]:
        if known.lower() == flavor.strip().lower():
            return known
    raise ConfigError(f"model.flavor='{flavor}' is not a {family} flavor (valid: {', '.join(FLAVORS[family])})")


def _check_positive(fields: dict[str, Any]) -> None:
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "multiple_of",
                "ffn_dim_multiplier", "norm_eps", "rope_theta", "max_seq_len"):
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                f"model.{key}={value!r} is not a number; write it unquoted (in YAML, 1.0e-5 rather than 1e-5)"
            )
        if value <= 0:
            raise ConfigError(f"model.{key}={value} must be positive; set a positive value or remove the key")


def _validate(args: LlamaArgs) -> None:
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
        value = getattr(args, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{key}={value!r} must be a positive integer")
    if args.dim % args.n_heads:
        lower = args.dim - args.dim % args.n_heads
        raise ConfigError(
            f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads} "
            f"(use dim {lower or args.n_heads} or {lower + args.n_heads}, or n_heads from {_divisors(args.dim)})"
        )
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={args.n_heads} is not a multiple of model.n_kv_heads={args.n_kv_heads} "
            f"(choose n_kv_heads from {_divisors(args.n_heads)})"
        )
    if args.head_dim % 2:
        raise ConfigError(
            f"model.dim/model.n_heads = {args.dim}/{args.n_heads} = {args.head_dim} is odd; rotary embedding needs "
            f"an even head_dim (choose n_heads so that dim/n_heads is even)"
        )
    if args.norm_eps <= 0 or args.rope_theta <= 0:
        raise ConfigError(
            f"model.norm_eps={args.norm_eps} and model.rope_theta={args.rope_theta} must both be positive"
        )
    if args.rope_scaling_factor is not None and args.rope_scaling_factor <= 0:
        raise ConfigError(
            f"model.rope_scaling_factor={args.rope_scaling_factor} must be positive (8.0 for Llama 3.1) or unset"
        )
    if args.family not in FLAVORS:
        raise ConfigError(f"model family '{args.family}' is unknown (valid: {', '.join(FLAVORS)})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

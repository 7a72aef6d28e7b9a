"""Shapes and options of the dense decoder (Llama, Qwen2, Qwen3), and their resolution from a family's flavors.

A family (models/<family>/) publishes flavors, each a dict of DecoderArgs fields (plus `multiple_of` /
`ffn_dim_multiplier`, Meta's rule for the SwiGLU width, where the flavor does not give `ffn_dim`); `resolve_args`
turns [model] into DecoderArgs: the flavor, then every explicit config field on top.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.intmath import divisor_hint
from titan_npu.knobs import FLAVOR_VALUE, Knob, at_least, size_key, switch_key

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# Llama 3.1 RoPE frequency scaling constants (Meta's apply_scaling); only the factor is configurable.
ROPE_SCALING_LOW_FREQ_FACTOR = 1.0
ROPE_SCALING_HIGH_FREQ_FACTOR = 4.0
ROPE_SCALING_ORIGINAL_CONTEXT = 8192

# The dense decoder's [model] keys, each overriding the flavor when set, with the values it accepts (every family
# built on the decoder takes them; config/options.py's model_key_rows() gathers them from the families' specs).
DECODER_KEYS: dict[str, Knob] = {
    "dim": size_key(),  # hidden size (alias d_model)
    "n_layers": size_key(),
    "n_heads": size_key(),
    "n_kv_heads": size_key(),
    "head_dim": size_key(),  # size of one attention head; unset = dim / n_heads (Qwen3's flavors set 128)
    "vocab_size": size_key(),
    "ffn_dim": size_key(),  # explicit SwiGLU hidden size; overrides multiplier/multiple_of
    "ffn_dim_multiplier": size_key(float),
    "multiple_of": size_key(),
    "norm_eps": size_key(float),
    "rope_theta": size_key(float),
    "rope_scaling_factor": Knob(at_least(0), why="0 or unset turns it off", kind=float),  # Llama 3.1's
    "max_seq_len": size_key(),
    "qkv_bias": switch_key(),  # biases on the q/k/v projections (Qwen2's flavors)
    "qk_norm": switch_key(),  # RMSNorm over each q/k head before RoPE (Qwen3's flavors)
    "tie_embeddings": switch_key(),  # output projection = embedding matrix (the small Llama 3.2 / Qwen flavors)
}
# The keys of YaRN's RoPE stretch, for the families that use it (DeepSeek-V3, gpt-oss; each takes those it reads).
YARN_KEYS: dict[str, Knob] = {
    "yarn_factor": Knob(at_least(0), why="0 = off", kind=float),  # 40 in DeepSeek's flavors; 0 = plain RoPE
    "yarn_original_seq_len": size_key(),  # the context YaRN stretches from (4096)
    "yarn_beta_fast": Knob(at_least(0), why=FLAVOR_VALUE, kind=float),  # YaRN's ramp bounds, in rotations (32, 1)
    "yarn_beta_slow": Knob(at_least(0), why=FLAVOR_VALUE, kind=float),
    "yarn_mscale": Knob(at_least(0), why=FLAVOR_VALUE, kind=float),  # magnitude scales of the tables and softmax
    "yarn_mscale_all_dim": Knob(at_least(0), why=FLAVOR_VALUE, kind=float),
    "yarn_truncate": switch_key(),  # round YaRN's ramp bounds to whole dims (false in gpt-oss's flavors)
}
# The decoder's keys that override a flavor when set (not None).
OVERRIDABLE = tuple(DECODER_KEYS)


@dataclass
class DecoderArgs:
    """Resolved shapes and hyperparameters of one dense decoder-only transformer."""

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
    head_dim: int | None = None  # None = dim / n_heads (Llama, Qwen2); Qwen3 sets it independently of dim
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3)
    tie_embeddings: bool = False  # the output projection is the embedding matrix (small Llama 3.2 / Qwen models)
    use_flash_attention: bool = True
    family: str = "llama2"
    flavor: str = "custom"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        explicit_head_dim = self.head_dim is not None
        if not explicit_head_dim:
            _check_heads_divide_dim(self)
            self.head_dim = self.dim // self.n_heads
        _validate(self)

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (n_heads x head_dim; dim unless head_dim is set apart)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together."""
        return self.n_kv_heads * self.head_dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Exact parameter count from the shapes; exclude_embedding drops the embedding lookup table (no FLOPs),
        which a tied model cannot drop: its matrix is the output projection as well."""
        attention = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim  # wq, wo + wk, wv
        if self.qkv_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += 2 * self.head_dim
        feed_forward = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        per_layer = attention + feed_forward + 2 * self.dim  # + attention_norm, ffn_norm
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = embedding + self.n_layers * per_layer + self.dim + output  # + norm
        return total - embedding if exclude_embedding and not self.tie_embeddings else total

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token meets (what its FLOPs count): every parameter of a dense model."""
        return self.num_params(exclude_embedding)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), PaLM's convention: 6 N + 12 L H D S (no causal halving),
        N the active non-embedding parameters."""
        return (6 * self.num_active_params(exclude_embedding=True)
                + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's SwiGLU hidden size: 2/3 of 4*dim, times the multiplier, rounded up to a multiple of multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def flavor_ffn_dim(preset: Mapping[str, Any]) -> int:
    """The SwiGLU width a flavor gives: its ffn_dim, else Meta's rule from multiple_of and the multiplier."""
    if preset.get("ffn_dim") is not None:
        return preset["ffn_dim"]
    return ffn_hidden_dim(preset["dim"], preset["multiple_of"], preset.get("ffn_dim_multiplier"))


def resolve_args(model_cfg: ModelConfig, family: str, flavors: Mapping[str, Mapping[str, Any]], flavor: str
                 ) -> DecoderArgs:
    """DecoderArgs of `flavor` of `family` with every explicit (non-None) [model] field on top."""
    fields: dict[str, Any] = dict(flavors[flavor])
    fields.update({k: getattr(model_cfg, k) for k in OVERRIDABLE if getattr(model_cfg, k, None) is not None})
    _check_numbers(fields)
    ffn_dim = fields.pop("ffn_dim", None)
    multiple_of = fields.pop("multiple_of", None)
    multiplier = fields.pop("ffn_dim_multiplier", None)
    if ffn_dim is None:
        if multiple_of is None:
            raise ConfigError(f"model.ffn_dim is not set and the {family} {flavor} flavor has no SwiGLU width rule; "
                              "set model.ffn_dim")
        ffn_dim = ffn_hidden_dim(fields["dim"], multiple_of, multiplier)
    # 0 means off, as None does.
    fields["rope_scaling_factor"] = fields.get("rope_scaling_factor") or None
    return DecoderArgs(**fields, ffn_dim=ffn_dim, use_flash_attention=bool(model_cfg.use_flash_attention),
                       family=family, flavor=flavor)


def matching_flavor(args: DecoderArgs, flavors: Mapping[str, Mapping[str, Any]], own: Collection[str] = ()) -> str:
    """The flavor whose shapes `args` has (weights imported from elsewhere), or 'custom'; `own`: a family's fields
    beyond the dense decoder's (MoE routing, MLA), which must equal the preset's too."""
    for flavor, preset in flavors.items():
        if any(getattr(args, k) != v for k, v in preset.items() if k in own):
            continue
        preset = {k: v for k, v in preset.items() if k not in own}
        shape = {k: preset[k] for k in ("dim", "n_layers", "n_heads", "vocab_size")}
        if any(getattr(args, k) != v for k, v in shape.items()):
            continue
        head_dim = preset.get("head_dim") or preset["dim"] // preset["n_heads"]
        same = (preset.get("n_kv_heads", preset["n_heads"]) == args.n_kv_heads and head_dim == args.head_dim
                and flavor_ffn_dim(preset) == args.ffn_dim
                and bool(preset.get("tie_embeddings", False)) == args.tie_embeddings
                and (preset.get("rope_scaling_factor") or None) == args.rope_scaling_factor)
        if same:
            return flavor
    return "custom"


def _check_numbers(fields: dict[str, Any]) -> None:
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "multiple_of",
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


def _check_heads_divide_dim(args: DecoderArgs) -> None:
    if isinstance(args.n_heads, int) and not isinstance(args.n_heads, bool) and args.n_heads > 0 \
            and isinstance(args.dim, int) and args.dim % args.n_heads:
        lower = args.dim - args.dim % args.n_heads
        raise ConfigError(
            f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads} "
            f"(use dim {lower or args.n_heads} or {lower + args.n_heads}, or n_heads from {divisor_hint(args.dim)}, "
            f"or set model.head_dim)"
        )


def _validate(args: DecoderArgs) -> None:
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "max_seq_len"):
        value = getattr(args, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{key}={value!r} must be a positive integer")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={args.n_heads} is not a multiple of model.n_kv_heads={args.n_kv_heads} "
            f"(choose n_kv_heads from {divisor_hint(args.n_heads)})"
        )
    if args.head_dim % 2:
        raise ConfigError(
            f"the head size (model.dim/model.n_heads = {args.dim}/{args.n_heads}, or model.head_dim) = "
            f"{args.head_dim} is odd; rotary embedding needs an even head_dim (choose n_heads so that dim/n_heads "
            f"is even, or an even model.head_dim)"
        )
    if args.norm_eps <= 0 or args.rope_theta <= 0:
        raise ConfigError(
            f"model.norm_eps={args.norm_eps} and model.rope_theta={args.rope_theta} must both be positive"
        )
    if args.rope_scaling_factor is not None and args.rope_scaling_factor <= 0:
        raise ConfigError(
            f"model.rope_scaling_factor={args.rope_scaling_factor} must be positive (8.0 for Llama 3.1) or unset"
        )


def present_fields(args: Any, keys: Collection[str]) -> list[tuple[str, Any]]:
    """(key, value) of each of `keys` that `args` has, in order (the [model] lines `titan-npu import` prints)."""
    return [(key, getattr(args, key)) for key in keys if hasattr(args, key)]

"""gpt-oss's shapes: the MoE decoder's (MoEDecoderArgs, every layer MoE) plus its own fields, the published flavors
(Hugging Face openai/gpt-oss-20b and openai/gpt-oss-120b config.json) and their resolution from [model]."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.knobs import Knob, size_key
from titan_npu.models.decoder.args import DECODER_KEYS, YARN_KEYS, DecoderArgs, resolve_args
from titan_npu.models.moe.args import MOE_KEYS, MoEArgs
from titan_npu.models.moe_decoder.args import MoEDecoderArgs

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
# gpt-oss's [model] keys, each overriding the flavor when set: the dense decoder's, the MoE ones it reads, YaRN's,
# attention sinks' sliding windows and the clamped SwiGLU experts.
GPT_OSS_KEYS: dict[str, Knob] = {
    **DECODER_KEYS,
    **{k: MOE_KEYS[k] for k in ("n_experts", "top_k", "moe_ffn_dim", "router_aux_loss_coef", "capacity_factor")},
    **{k: YARN_KEYS[k] for k in ("yarn_factor", "yarn_original_seq_len", "yarn_beta_fast", "yarn_beta_slow")},
    "sliding_window": size_key(),  # keys a sliding layer's query sees (128 in the published flavors)
    # per layer; unset = alternating sliding and full
    "layer_types": Knob(choices=(SLIDING, FULL), what="attention layer type", each=True, kind=list[str]),
    "swiglu_limit": size_key(float),  # the experts' SwiGLU clamp (7.0)
    "yarn_truncate": YARN_KEYS["yarn_truncate"],
}
# The keys of gpt-oss's own part (beyond the dense decoder's) that override a flavor when set.
GPT_OSS_OVERRIDABLE = tuple(k for k in GPT_OSS_KEYS if k not in DECODER_KEYS)
# The fields a flavor sets beyond the dense decoder's.
OWN_FIELDS = (*GPT_OSS_OVERRIDABLE, "swiglu_alpha")

_GPT_OSS: dict[str, Any] = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880, moe_ffn_dim=2880,
                                vocab_size=201088, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072, top_k=4,
                                qkv_bias=True, tie_embeddings=False, sliding_window=128, router_aux_loss_coef=0.001,
                                yarn_factor=32.0, yarn_original_seq_len=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0)
FLAVORS: dict[str, dict[str, Any]] = {
    # A tiny gpt-oss for CPU runs and tests: 8 experts, top-4, a 16-token window, the 2,048-token tokenizer.
    "debug": {**_GPT_OSS, **dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
                                 moe_ffn_dim=128, vocab_size=2048, max_seq_len=2048, n_experts=8, sliding_window=16,
                                 yarn_original_seq_len=256)},
    "20B": dict(**_GPT_OSS, n_layers=24, n_experts=32),
    "120B": dict(**_GPT_OSS, n_layers=36, n_experts=128),
}


@dataclass
class GptOssArgs(MoEDecoderArgs):
    """A decoder whose every layer is MoE (top-k softmax over the chosen logits, biased gate and experts, clamped
    SwiGLU), whose attention has biases on q/k/v/o and a learned sink logit per head, and whose layers alternate a
    sliding window (layer_types, even layers by default) with full causal attention; RoPE is YaRN-stretched."""

    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)  # per layer SLIDING or FULL; empty = alternating
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    yarn_factor: float | None = 32.0  # None = plain RoPE
    yarn_original_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = False  # round the YaRN ramp's bounds to whole dims (transformers' `truncate`)

    def __post_init__(self) -> None:
        self.qkv_bias = True
        if not self.layer_types:
            self.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(self.n_layers)]
        self.layer_types = list(self.layer_types)
        super().__post_init__()
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ConfigError(f"layer_types {self.layer_types} must give {SLIDING!r} or {FULL!r} for each of the "
                              f"{self.n_layers} layers")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ConfigError(f"sliding_window={self.sliding_window!r} must be a positive integer")
        if self.yarn_factor is not None and self.yarn_factor <= 0:
            raise ConfigError(f"model.yarn_factor={self.yarn_factor} must be positive, or 0 / unset for plain RoPE")
        if self.capacity_factor is not None or self.shared_ffn_dim or self.mlp_only_layers \
                or self.decoder_sparse_step != 1:
            raise ConfigError("gpt-oss routes every token of every layer (no capacity factor, shared expert, dense "
                              "layer or sparse step); unset model.capacity_factor / shared_ffn_dim")

    def moe_args(self) -> MoEArgs:
        """The arguments of this model's MoE layers: top-k softmax weights, biased gate and experts, clamped SwiGLU."""
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k, ffn_dim=self.moe_ffn_dim,
                       norm_topk_prob=True, capacity_factor=self.capacity_factor, router_bias=True, expert_bias=True,
                       swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)

    def window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id`, None for full attention."""
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else None

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Every parameter, all experts included (the o-projection's bias and the sinks as well)."""
        return super().num_params(exclude_embedding) + self.n_layers * (self.dim + self.n_heads)

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """The parameters one token meets: the router and its top_k experts of each layer, attention whole."""
        return super().num_active_params(exclude_embedding) + self.n_layers * (self.dim + self.n_heads)

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 N (active, non-embedding) + 12 H D per layer times the keys a query sees there: seq_len in a full
        layer, at most the window in a sliding one (no causal halving, as the dense decoder counts)."""
        keys = sum(seq_len if self.window(i) is None else min(seq_len, self.sliding_window)
                   for i in range(self.n_layers))
        return 6 * self.num_active_params(exclude_embedding=True) + 12 * self.n_heads * self.head_dim * keys

    def yarn_attention_factor(self) -> float:
        """YaRN's magnitude correction of the cos/sin tables (1 for plain RoPE)."""
        factor = self.yarn_factor or 1.0
        return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def build_args(model_cfg: ModelConfig, flavor: str) -> GptOssArgs:
    """[model] resolved into the args of gpt-oss `flavor`."""
    preset = dict(FLAVORS[flavor])
    own = {k: preset.pop(k) for k in OWN_FIELDS if k in preset}
    own.update({k: getattr(model_cfg, k) for k in GPT_OSS_OVERRIDABLE if getattr(model_cfg, k, None) is not None})
    own["capacity_factor"] = own.get("capacity_factor") or None
    own["yarn_factor"] = own.get("yarn_factor") or None  # 0 means plain RoPE, as None does
    own["layer_types"] = own.get("layer_types") or []  # empty = alternating
    dense = resolve_args(model_cfg, "gpt_oss", {flavor: preset}, flavor)
    return GptOssArgs(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}, **own)


def args_from_dict(fields: dict[str, Any]) -> GptOssArgs:
    """GptOssArgs from a checkpoint's stored fields."""
    known = GptOssArgs.__dataclass_fields__
    return GptOssArgs(**{k: v for k, v in fields.items() if k in known})

"""GLM-4.5's shapes: the MoE decoder's (MoEDecoderArgs: GQA attention with q/k/v biases and optional q/k norms, the
MoE fields) plus partial RoPE and DeepSeek-V3's routing (sigmoid scores, a score-correction bias moved by aux-loss-free
balancing, group-limited top-k, a scale on the routed weights, shared experts, dense first layers); the published
flavors and their resolution from [model].

Flavors, from the Hugging Face config.json of each (transformers' Glm4MoeConfig reads them):
  "4.5"     zai-org/GLM-4.5      (355B total, 32B active): 92 layers, dim 5120, 96 heads of 128, 8 KV heads,
            160 experts (top 8, ffn 1536) + 1 shared, first 3 layers dense (ffn 12288), q/k norms, scale 2.5
  "4.5-air" zai-org/GLM-4.5-Air  (106B total, 12B active): 46 layers, dim 4096, 96 heads of 128, 8 KV heads,
            128 experts (top 8, ffn 1408) + 1 shared, first layer dense (ffn 10944), no q/k norms, scale 1.0
Both: q/k/v biases (attention_bias), half of each head rotated (partial_rotary_factor 0.5), rope_theta 1e6, one group
(n_group = topk_group = 1), top-k weights renormalised, vocabulary 151552, 131072 positions, rms_norm_eps 1e-5, and one
multi-token-prediction layer (num_nextn_predict_layers 1) that import sets aside (docs/models.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.knobs import Knob, between, off_key, size_key
from titan_npu.models.decoder.args import DECODER_KEYS, DecoderArgs, resolve_args
from titan_npu.models.moe.args import MOE_KEYS, MoEArgs
from titan_npu.models.moe_decoder.args import MoEDecoderArgs

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# GLM-4.5's [model] keys, each overriding the flavor when set: the dense decoder's (but Llama 3.1's frequency scaling,
# which GLM has not), the MoE ones it reads, partial RoPE and DeepSeek-V3's routing keys.
GLM4_MOE_KEYS: dict[str, Knob] = {
    **{k: v for k, v in DECODER_KEYS.items() if k != "rope_scaling_factor"},
    **{k: MOE_KEYS[k] for k in ("n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob")},
    "partial_rotary_factor": Knob(between(0, 1, low_open=True), why="the share of each head RoPE rotates",
                                  kind=float),
    "n_shared_experts": off_key(int),  # always-on experts, each moe_ffn_dim wide
    "n_groups": size_key(),  # expert groups of group-limited routing
    "topk_groups": size_key(),  # groups a token's experts may come from
    "route_scale": size_key(float),  # factor on the routed experts' weights (routed_scaling_factor)
    "first_k_dense": off_key(int),  # the first k layers keep a dense SwiGLU (first_k_dense_replace)
    "score_bias_rate": off_key(),  # aux-loss-free balancing: score bias step per optimizer step
}
# The keys of GLM's own part (beyond the dense decoder's) that override a flavor when set.
GLM4_MOE_OVERRIDABLE = tuple(k for k in GLM4_MOE_KEYS if k not in DECODER_KEYS)

_GLM = dict(head_dim=128, n_kv_heads=8, qkv_bias=True, vocab_size=151552, norm_eps=1e-5, rope_theta=1000000.0,
            max_seq_len=131072, tie_embeddings=False, partial_rotary_factor=0.5, n_shared_experts=1, n_groups=1,
            topk_groups=1, norm_topk_prob=True, top_k=8)
FLAVORS: dict[str, dict[str, Any]] = {
    # A tiny GLM for CPU runs and tests: the first layer dense, 8 experts in 2 groups (top-2 from 1), q/k norms.
    "debug": {**_GLM, **dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128, vocab_size=512,
                             max_seq_len=1024, qk_norm=True, n_experts=8, top_k=2, moe_ffn_dim=32, n_groups=2,
                             topk_groups=1, route_scale=2.5, first_k_dense=1)},
    "4.5": dict(**_GLM, dim=5120, n_layers=92, n_heads=96, ffn_dim=12288, qk_norm=True, n_experts=160,
                moe_ffn_dim=1536, route_scale=2.5, first_k_dense=3),
    "4.5-air": dict(**_GLM, dim=4096, n_layers=46, n_heads=96, ffn_dim=10944, qk_norm=False, n_experts=128,
                    moe_ffn_dim=1408, route_scale=1.0, first_k_dense=1),
}


@dataclass
class Glm4MoeArgs(MoEDecoderArgs):
    """A GLM-4.5 model: the MoE decoder with every layer from first_k_dense on MoE, routed by the group-limited sigmoid
    router with a score-correction bias, n_shared_experts always-on experts (shared_ffn_dim follows), and RoPE on the
    first partial_rotary_factor of each head. No load-balancing loss (router_aux_loss_coef 0): the bias balances."""

    partial_rotary_factor: float = 0.5
    n_shared_experts: int = 1
    n_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0
    first_k_dense: int = 1
    score_bias_rate: float = 0.001  # aux-loss-free balancing step; 0 = the bias never moves

    def __post_init__(self) -> None:
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ConfigError(f"model.n_shared_experts={self.n_shared_experts!r} must be 0 or a positive integer")
        self.shared_ffn_dim = self.n_shared_experts * self.moe_ffn_dim
        self.router_aux_loss_coef = 0.0
        super().__post_init__()
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ConfigError(f"model.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give "
                              f"an even, non-zero number of rotated dims of the {self.head_dim}-dim head")
        if not isinstance(self.first_k_dense, int) or not 0 <= self.first_k_dense <= self.n_layers:
            raise ConfigError(f"model.first_k_dense={self.first_k_dense!r} must lie in 0..n_layers={self.n_layers}")
        if self.score_bias_rate < 0:
            raise ConfigError(f"model.score_bias_rate={self.score_bias_rate} must be >= 0 (0 = off)")

    @property
    def rotary_dim(self) -> int:
        """How many dims of each q/k head RoPE rotates (transformers: int(head_dim x partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def moe_args(self) -> MoEArgs:
        """The arguments of this model's MoE layers: DeepSeek-V3's router over GLM's experts."""
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k, ffn_dim=self.moe_ffn_dim,
                       norm_topk_prob=self.norm_topk_prob, shared_ffn_dim=self.n_shared_experts * self.moe_ffn_dim,
                       score_bias=True, router="sigmoid_group", n_groups=self.n_groups, topk_groups=self.topk_groups,
                       route_scale=self.route_scale)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a MoE feed-forward (all from first_k_dense on)."""
        return layer_id >= self.first_k_dense


def build_args(model_cfg: ModelConfig, flavor: str) -> Glm4MoeArgs:
    """[model] resolved into the args of GLM-4.5 `flavor`."""
    preset = dict(FLAVORS[flavor])
    own = {k: preset.pop(k) for k in GLM4_MOE_OVERRIDABLE if k in preset}
    own.update({k: getattr(model_cfg, k) for k in GLM4_MOE_OVERRIDABLE if getattr(model_cfg, k, None) is not None})
    dense = resolve_args(model_cfg, "glm4_moe", {flavor: preset}, flavor)
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}
    return Glm4MoeArgs(**fields, **own)


def args_from_dict(fields: dict[str, Any]) -> Glm4MoeArgs:
    """Glm4MoeArgs from a checkpoint's stored fields."""
    known = Glm4MoeArgs.__dataclass_fields__
    return Glm4MoeArgs(**{k: v for k, v in fields.items() if k in known})

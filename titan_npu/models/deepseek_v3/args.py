"""DeepSeek-V3's shapes: the decoder's (DecoderArgs: dim, layers, heads, vocabulary, the dense SwiGLU width) plus
multi-head latent attention, the MoE routing and YaRN RoPE; the published flavors and their resolution from
[model].

Flavors (Hugging Face config.json of each): 671B is deepseek-ai/DeepSeek-V3; 236B is DeepSeek-V2's shapes and
16B DeepSeek-V2-Lite's, both routed the V3 way (sigmoid scores, score bias), as torchtitan's flavors of those sizes
are; debug is a tiny model for CPU runs and tests. kimi-k2 is Moonshot AI's Kimi K2 (moonshotai/Kimi-K2-Base and
Kimi-K2-Instruct config.json, model_type "kimi_k2" on DeepseekV3ForCausalLM): DeepSeek-V3's architecture with 384
routed experts in one group, 64 heads, one dense layer, no multi-token prediction, rope_theta 50000 and YaRN 32x from
4096 positions with both ramp bounds at 1 rotation (1.026T parameters, 32.9B active).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.knobs import FLAVOR_VALUE, Knob, at_least, off_key, size_key
from titan_npu.models.decoder.args import DECODER_KEYS, YARN_KEYS, DecoderArgs, resolve_args
from titan_npu.models.moe.args import MOE_KEYS, MoEArgs

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# DeepSeek-V3's [model] keys, each overriding the flavor when set: the dense decoder's, the MoE routing ones it
# reads, multi-head latent attention's ranks, group-limited routing, aux-loss-free balancing, multi-token prediction
# and YaRN (the published flavors stretch RoPE 40x from 4096 positions).
DEEPSEEK_KEYS: dict[str, Knob] = {
    **DECODER_KEYS,
    **{k: MOE_KEYS[k] for k in ("n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob")},
    "q_lora_rank": off_key(int),  # rank of the query's low-rank path; 0 = a plain query projection
    "kv_lora_rank": size_key(),  # rank of the compressed key/value latent
    "qk_nope_head_dim": Knob(at_least(0), why=FLAVOR_VALUE, kind=int),  # per-head q/k width without RoPE
    "qk_rope_head_dim": Knob(at_least(0), why=FLAVOR_VALUE, kind=int),  # with RoPE (the key's shared by every head)
    "v_head_dim": size_key(),  # per-head value width
    "n_shared_experts": off_key(int),  # always-on experts, each moe_ffn_dim wide
    "n_groups": size_key(),  # expert groups of group-limited routing
    "topk_groups": size_key(),  # groups a token's experts may come from
    "route_scale": size_key(float),  # factor on the routed experts' weights (routed_scaling_factor)
    "first_k_dense": off_key(int),  # the first k layers keep a dense SwiGLU (first_k_dense_replace)
    "score_bias_rate": off_key(),  # aux-loss-free balancing: score bias step per optimizer step
    "seq_aux_loss_coef": off_key(),  # weight of the sequence-wise balance loss
    "mtp_depth": off_key(int),  # multi-token prediction modules; 0 = none
    **{k: v for k, v in YARN_KEYS.items() if k != "yarn_truncate"},
    "mtp_loss_coef": off_key(),  # weight of the multi-token prediction loss
}
# The keys of DeepSeek's own part (beyond the dense decoder's) that override a flavor when set.
DEEPSEEK_OVERRIDABLE = tuple(k for k in DEEPSEEK_KEYS if k not in DECODER_KEYS and not k.startswith("yarn_"))
# YaRN's fields; [model] overrides them too.
YARN_FIELDS = tuple(k for k in DEEPSEEK_KEYS if k.startswith("yarn_"))

_YARN_40 = dict(max_seq_len=163840, yarn_factor=40.0, yarn_original_seq_len=4096, yarn_beta_fast=32.0,
                yarn_beta_slow=1.0)
FLAVORS: dict[str, dict[str, Any]] = {
    # 4 layers (the first dense), a low-rank query, 8 experts in 4 groups (top-2 from the best 2), one shared expert.
    "debug": dict(dim=128, n_layers=4, n_heads=4, vocab_size=2048, ffn_dim=256, norm_eps=1e-6, rope_theta=10000.0,
                  max_seq_len=2048, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, n_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, n_groups=4,
                  topk_groups=2, route_scale=1.0, norm_topk_prob=True, first_k_dense=1),
    "16B": dict(dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_dim=10944, norm_eps=1e-6,
                rope_theta=10000.0, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, n_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2, n_groups=1,
                topk_groups=1, route_scale=1.0, norm_topk_prob=False, first_k_dense=1, yarn_mscale=0.707,
                yarn_mscale_all_dim=0.707, **_YARN_40),
    "236B": dict(dim=5120, n_layers=60, n_heads=128, vocab_size=102400, ffn_dim=12288, norm_eps=1e-6,
                 rope_theta=10000.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, n_experts=160, top_k=6, moe_ffn_dim=1536, n_shared_experts=2, n_groups=8,
                 topk_groups=3, route_scale=16.0, norm_topk_prob=False, first_k_dense=1, yarn_mscale=0.707,
                 yarn_mscale_all_dim=0.707, **_YARN_40),
    "671B": dict(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_dim=18432, norm_eps=1e-6,
                 rope_theta=10000.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1, n_groups=8,
                 topk_groups=4, route_scale=2.5, norm_topk_prob=True, first_k_dense=3, yarn_mscale=1.0,
                 yarn_mscale_all_dim=1.0, **_YARN_40),
    "kimi-k2": dict(dim=7168, n_layers=61, n_heads=64, vocab_size=163840, ffn_dim=18432, norm_eps=1e-6,
                    rope_theta=50000.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128, n_experts=384, top_k=8, moe_ffn_dim=2048, n_shared_experts=1, n_groups=1,
                    topk_groups=1, route_scale=2.827, norm_topk_prob=True, first_k_dense=1, max_seq_len=131072,
                    yarn_factor=32.0, yarn_original_seq_len=4096, yarn_beta_fast=1.0, yarn_beta_slow=1.0,
                    yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
}


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class DeepSeekArgs(DecoderArgs):
    """A DeepSeek-V3 model. head_dim is the query/key head width (qk_nope_head_dim + qk_rope_head_dim); every layer
    from first_k_dense on is MoE; q_lora_rank 0 = a plain query projection; yarn_factor None = plain RoPE."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 256
    n_shared_experts: int = 1
    n_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense: int = 1
    score_bias_rate: float = 0.001  # aux-loss-free balancing step; 0 = the bias never moves
    seq_aux_loss_coef: float = 0.0  # the sequence-wise balance loss's weight; 0 = off
    mtp_depth: int = 0  # multi-token prediction modules after the last layer; 0 = none
    mtp_loss_coef: float = 0.3  # weight of their mean cross entropy in the optimised loss (the paper's lambda)
    yarn_factor: float | None = None
    yarn_original_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")
        if self.q_lora_rank is None or self.q_lora_rank < 0:
            raise ConfigError(f"model.q_lora_rank={self.q_lora_rank!r} must be >= 0 (0 = a plain query projection)")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        self.n_kv_heads = self.n_heads
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        super().__post_init__()
        if not 0 <= self.first_k_dense <= self.n_layers:
            raise ConfigError(f"model.first_k_dense={self.first_k_dense} must lie in 0..n_layers={self.n_layers}")
        if self.score_bias_rate < 0 or self.seq_aux_loss_coef < 0:
            raise ConfigError(f"model.score_bias_rate={self.score_bias_rate} and model.seq_aux_loss_coef="
                              f"{self.seq_aux_loss_coef} must be >= 0 (0 = off)")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0 or self.mtp_loss_coef < 0:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth!r} and model.mtp_loss_coef={self.mtp_loss_coef} "
                              f"must be >= 0 (mtp_depth 0 = no multi-token prediction)")
        if self.yarn_factor is not None and self.yarn_factor <= 0:
            raise ConfigError(f"the YaRN factor {self.yarn_factor} must be positive, or None for plain RoPE")
        self.moe_args()  # validates the MoE shapes

    def moe_args(self) -> MoEArgs:
        """The arguments of this model's MoE layers."""
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k, ffn_dim=self.moe_ffn_dim,
                       norm_topk_prob=self.norm_topk_prob, shared_ffn_dim=self.n_shared_experts * self.moe_ffn_dim,
                       score_bias=True, router="sigmoid_group", n_groups=self.n_groups, topk_groups=self.topk_groups,
                       route_scale=self.route_scale)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a MoE feed-forward (all from first_k_dense on)."""
        return layer_id >= self.first_k_dense

    @property
    def n_moe_layers(self) -> int:
        """How many layers are MoE."""
        return self.n_layers - self.first_k_dense

    @property
    def softmax_scale(self) -> float:
        """Attention's softmax scale: head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
        scale = self.head_dim ** -0.5
        if self.yarn_factor is not None and self.yarn_mscale_all_dim:
            scale *= yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2
        return scale

    def attention_params(self) -> int:
        """Parameters of one multi-head latent attention (projections and the low-rank paths' norms)."""
        d, h = self.dim, self.n_heads
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.head_dim
        else:
            q = d * h * self.head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def mtp_params(self, per_moe_layer: int) -> int:
        """Parameters of the multi-token prediction modules (each a MoE layer, its two input norms, its projection
        of both down to dim and its output norm; the embedding and output head are the model's)."""
        block = self.attention_params() + 2 * self.dim + per_moe_layer
        return self.mtp_depth * (block + 2 * self.dim + 2 * self.dim * self.dim + self.dim)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Every parameter, all experts and the multi-token prediction modules included."""
        return self._count(self.moe_args().total_params(), exclude_embedding)

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """The parameters one token meets: the router, its top_k experts and the shared experts of each MoE
        layer."""
        return self._count(self.moe_args().active_params(), exclude_embedding)

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 N (active, non-embedding) + attention's 6 L H S (qk head + v head) (no causal halving)."""
        return (6 * self.num_active_params(exclude_embedding=True)
                + 6 * self.n_layers * self.n_heads * seq_len * (self.head_dim + self.v_head_dim))

    def _count(self, per_moe_layer: int, exclude_embedding: bool) -> int:
        dense_ffn = 3 * self.dim * self.ffn_dim
        layers = self.n_layers * (self.attention_params() + 2 * self.dim) + self.first_k_dense * dense_ffn \
            + self.n_moe_layers * per_moe_layer + self.mtp_params(per_moe_layer)
        embedding = self.vocab_size * self.dim
        total = embedding + layers + self.dim + (0 if self.tie_embeddings else embedding)
        return total - embedding if exclude_embedding and not self.tie_embeddings else total


def build_args(model_cfg: ModelConfig, flavor: str) -> DeepSeekArgs:
    """[model] resolved into the args of DeepSeek-V3 `flavor`."""
    return resolve_deepseek_args(model_cfg, flavor, FLAVORS, "deepseek_v3", DEEPSEEK_OVERRIDABLE, DeepSeekArgs)


def resolve_deepseek_args(model_cfg: ModelConfig, flavor: str, flavors: dict[str, dict[str, Any]], family: str,
                          overridable: tuple[str, ...], cls: type[DeepSeekArgs]) -> DeepSeekArgs:
    """[model] resolved into `cls` (DeepSeekArgs or a family's extension of it) of `flavor` of `flavors`: the
    decoder's fields, and the `overridable` and YaRN ones from the preset, then [model]."""
    preset = dict(flavors[flavor])
    own = {k: preset.pop(k) for k in (*overridable, *YARN_FIELDS) if k in preset}
    own.update({k: getattr(model_cfg, k) for k in (*overridable, *YARN_FIELDS)
                if getattr(model_cfg, k, None) is not None})
    own["yarn_factor"] = own.get("yarn_factor") or None  # 0 means plain RoPE, as None does
    dense = resolve_args(model_cfg, family, {flavor: preset}, flavor)
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}
    return cls(**fields, **own)


def args_from_dict(fields: dict[str, Any]) -> DeepSeekArgs:
    """DeepSeekArgs from a checkpoint's stored fields."""
    known = DeepSeekArgs.__dataclass_fields__
    return DeepSeekArgs(**{k: v for k, v in fields.items() if k in known})

"""Qwen3-Next / Qwen3.5's shapes: the MoE decoder's (MoEDecoderArgs; n_experts = 0 for the dense Qwen3.5) plus the
hybrid's own fields, the published flavors and their resolution from [model].

Where each flavor's numbers come from (Hugging Face config.json, Qwen3.5's from its text_config):
  80B-A3B     Qwen/Qwen3-Next-80B-A3B-Instruct (transformers' Qwen3NextConfig defaults are the same model, but for
              intermediate_size 5632 there and rope_theta 10000 there; the published file has 5120 and 1e7)
  3.5-9B      Qwen/Qwen3.5-9B (dense: hidden 4096, 32 layers, intermediate 12288, 16 / 4 heads of 256)
  3.5-35B-A3B Qwen/Qwen3.5-35B-A3B (hidden 2048, 40 layers, 256 experts top-8 of 512, shared 512)
  3.5-397B-A17B Qwen/Qwen3.5-397B-A17B (hidden 4096, 60 layers, 512 experts top-10 of 1024, shared 1024, 64 value
              heads in the linear layers)
Common to all: head_dim 256, partial_rotary_factor 0.25, rope_theta 1e7, full_attention_interval 4, linear key /
value heads of 128, a width-4 short convolution, rms_norm_eps 1e-6, max_position_embeddings 262144, untied output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.knobs import Knob, between, size_key
from titan_npu.models.decoder.args import DecoderArgs, resolve_args
from titan_npu.models.moe.args import MoEArgs
from titan_npu.models.moe_decoder.args import MOE_DECODER_KEYS, MOE_OVERRIDABLE, MoEDecoderArgs

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

LINEAR, FULL = "linear_attention", "full_attention"
VARIANTS = ("qwen3_next", "qwen3_5")  # the Hugging Face layout the weights export to (hf.py)
# The hybrid's own [model] keys (gated DeltaNet linear layers between gated attention ones), each overriding the
# flavor when set.
HYBRID_KEYS: dict[str, Knob] = {
    # per layer; unset = every full_attention_interval-th layer is full attention
    "layer_types": Knob(choices=(LINEAR, FULL), what="attention layer type", each=True, kind=list[str]),
    "full_attention_interval": size_key(),  # every n-th layer is full attention when layer_types is unset (4)
    "partial_rotary_factor": Knob(between(0, 1, low_open=True), why="the share of each head RoPE rotates",
                                  kind=float),  # 0.25
    "linear_n_k_heads": size_key(),  # the linear layers' query / key heads
    "linear_n_v_heads": size_key(),  # their value heads (a multiple of the key heads)
    "linear_k_head_dim": size_key(),
    "linear_v_head_dim": size_key(),
    "linear_conv_kernel": size_key(),  # width of the short causal convolution (4)
    "variant": Knob(choices=VARIANTS, what="Hugging Face layout", kind=str),  # the layout export writes
}
# Every [model] key of Qwen3-Next / Qwen3.5: the MoE decoder's, then the hybrid's.
QWEN3_NEXT_KEYS: dict[str, Knob] = {**MOE_DECODER_KEYS, **HYBRID_KEYS}
HYBRID_OVERRIDABLE = tuple(HYBRID_KEYS)
OVERRIDABLE = (*MOE_OVERRIDABLE, *HYBRID_OVERRIDABLE)
# The fields a flavor sets beyond the dense decoder's.
OWN_FIELDS = OVERRIDABLE

_COMMON: dict[str, Any] = dict(head_dim=256, norm_eps=1e-6, rope_theta=1e7, max_seq_len=262144, qk_norm=True,
                               tie_embeddings=False, full_attention_interval=4, partial_rotary_factor=0.25,
                               linear_n_k_heads=16, linear_n_v_heads=32, linear_k_head_dim=128, linear_v_head_dim=128,
                               linear_conv_kernel=4, router_aux_loss_coef=0.001, norm_topk_prob=True)
_NEXT = dict(_COMMON, vocab_size=151936, variant="qwen3_next")
_QWEN3_5 = dict(_COMMON, vocab_size=248320, variant="qwen3_5")
_DEBUG = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048, max_seq_len=2048,
              linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32)
FLAVORS: dict[str, dict[str, Any]] = {
    # Tiny hybrids for CPU runs and tests (three linear layers then a full one; the 2,048-token tokenizer): MoE with
    # 8 experts top-2 and a shared expert, and dense.
    "debug": {**_NEXT, **_DEBUG, **dict(ffn_dim=256, n_experts=8, top_k=2, moe_ffn_dim=64, shared_ffn_dim=64)},
    "debug-dense": {**_QWEN3_5, **_DEBUG, **dict(ffn_dim=256, n_experts=0, top_k=1, moe_ffn_dim=0)},
    "80B-A3B": dict(_NEXT, dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, ffn_dim=5120, n_experts=512, top_k=10,
                    moe_ffn_dim=512, shared_ffn_dim=512),
    "3.5-9B": dict(_QWEN3_5, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=12288, n_experts=0, top_k=1,
                   moe_ffn_dim=0),
    "3.5-35B-A3B": dict(_QWEN3_5, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, ffn_dim=512, n_experts=256, top_k=8,
                        moe_ffn_dim=512, shared_ffn_dim=512),
    "3.5-397B-A17B": dict(_QWEN3_5, dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, ffn_dim=1024, n_experts=512,
                          top_k=10, moe_ffn_dim=1024, shared_ffn_dim=1024, linear_n_v_heads=64),
}


@dataclass
class Qwen3NextArgs(MoEDecoderArgs):
    """A hybrid decoder: per layer (layer_types) gated DeltaNet linear attention or gated full attention (q doubled
    into a query and a sigmoid output gate per head, q/k RMSNorm, RoPE on the first partial_rotary_factor of each
    head), every norm zero-centred (scale 1 + weight); MoE feed-forwards with a sigmoid-gated shared expert, or the
    dense SwiGLU everywhere when n_experts = 0 (Qwen3.5 dense)."""

    layer_types: list[str] = field(default_factory=list)  # per layer LINEAR or FULL; empty = full_attention_interval
    full_attention_interval: int = 4  # every n-th layer is full attention (the rest linear)
    partial_rotary_factor: float = 0.25
    linear_n_k_heads: int = 16
    linear_n_v_heads: int = 32
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    linear_conv_kernel: int = 4
    variant: str = "qwen3_next"

    def __post_init__(self) -> None:
        self.qk_norm = True
        if not isinstance(self.full_attention_interval, int) or self.full_attention_interval < 1:
            raise ConfigError(f"model.full_attention_interval={self.full_attention_interval!r} must be a positive "
                              f"integer (4: three linear layers, then a full one)")
        if not self.layer_types:
            self.layer_types = [FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                for i in range(self.n_layers)]
        self.layer_types = list(self.layer_types)
        if not self.n_experts:
            self.n_experts, self.top_k, self.moe_ffn_dim, self.shared_ffn_dim = 0, 1, 0, 0
        elif self.variant == "qwen3_5":
            self.ffn_dim = self.moe_ffn_dim  # Qwen3.5-MoE has no dense layer (its config.json no intermediate_size)
        if self.n_experts:
            super().__post_init__()
        else:
            DecoderArgs.__post_init__(self)
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ConfigError(f"model.layer_types {self.layer_types} must give {LINEAR!r} or {FULL!r} for each of "
                              f"the {self.n_layers} layers")
        for key in ("linear_n_k_heads", "linear_n_v_heads", "linear_k_head_dim", "linear_v_head_dim",
                    "linear_conv_kernel"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")
        if self.linear_n_v_heads % self.linear_n_k_heads:
            raise ConfigError(f"model.linear_n_v_heads={self.linear_n_v_heads} must be a multiple of "
                              f"model.linear_n_k_heads={self.linear_n_k_heads} (each key head serves whole value "
                              f"heads)")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"model.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give "
                              f"an even number of rotated dims of head_dim={self.head_dim}")
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant {self.variant!r} is not a Qwen3-Next layout (valid: {', '.join(VARIANTS)})")
        if self.variant == "qwen3_5" and self.n_experts and (not self.norm_topk_prob or self.mlp_only_layers
                                                             or self.decoder_sparse_step != 1):
            raise ConfigError("Qwen3.5-MoE routes every layer and renormalises the top-k weights; set "
                              "model.norm_topk_prob = true and leave mlp_only_layers / decoder_sparse_step unset")

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q / k head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """Width of the linear layer's q (or k): key heads x key head dim."""
        return self.linear_n_k_heads * self.linear_k_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Width of the linear layer's v (and of its output gate z)."""
        return self.linear_n_v_heads * self.linear_v_head_dim

    def is_linear_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` mixes tokens by gated DeltaNet (else gated full attention)."""
        return self.layer_types[layer_id] == LINEAR

    @property
    def n_linear_layers(self) -> int:
        """How many layers are linear attention."""
        return sum(map(self.is_linear_layer, range(self.n_layers)))

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a MoE feed-forward (none in a dense model)."""
        return bool(self.n_experts) and super().is_moe_layer(layer_id)

    def moe_args(self) -> MoEArgs:
        """The MoE layers' arguments: softmax top-k and a shared expert behind a sigmoid gate."""
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k, ffn_dim=self.moe_ffn_dim,
                       norm_topk_prob=self.norm_topk_prob, capacity_factor=self.capacity_factor,
                       shared_ffn_dim=self.shared_ffn_dim, shared_gate=bool(self.shared_ffn_dim))

    def linear_attention_params(self) -> int:
        """Parameters of one gated DeltaNet layer: q/k/v/z/b/a projections, conv, A_log, dt_bias, norm, out."""
        d, k, v, h = self.dim, self.linear_key_dim, self.linear_value_dim, self.linear_n_v_heads
        return d * (2 * k + 2 * v + 2 * h) + (2 * k + v) * self.linear_conv_kernel + 2 * h \
            + self.linear_v_head_dim + v * d

    def full_attention_params(self) -> int:
        """Parameters of one gated attention layer: q (and its gate), k, v, o, the q / k norms."""
        return 3 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + 2 * self.head_dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Every parameter, all experts included."""
        return self._with_mixers(super().num_params(exclude_embedding) if self.n_experts
                                 else DecoderArgs.num_params(self, exclude_embedding))

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """The parameters one token meets (the router, its top_k experts and the shared expert of a MoE layer)."""
        return self._with_mixers(super().num_active_params(exclude_embedding) if self.n_experts
                                 else DecoderArgs.num_params(self, exclude_embedding))

    def _with_mixers(self, decoder_total: int) -> int:
        """The decoder's count with its attentions swapped for this model's token mixers."""
        decoder_attention = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + 2 * self.head_dim
        n_linear = self.n_linear_layers
        return (decoder_total - self.n_layers * decoder_attention + n_linear * self.linear_attention_params()
                + (self.n_layers - n_linear) * self.full_attention_params())

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 N (active, non-embedding) + the token mixing: 12 H D S per full layer (as the dense decoder counts,
        no causal halving) and, per linear layer, the chunked delta rule's matmuls (chunk_flops_per_token)."""
        full = self.n_layers - self.n_linear_layers
        return (6 * self.num_active_params(exclude_embedding=True)
                + 12 * self.n_heads * self.head_dim * seq_len * full
                + self.n_linear_layers * self.chunk_flops_per_token(min(seq_len, 64)))

    def chunk_flops_per_token(self, chunk: int) -> int:
        """Training FLOPs per token of one linear layer's chunked delta rule (forward x 3): per value head, the
        chunk's k k^T and q k^T (2 C dk each), the triangular solves for u and w (C dv + C dk), the state's read,
        overwrite and write (2 dk dv each, three times) and the intra-chunk output (2 C dv)."""
        dk, dv, c = self.linear_k_head_dim, self.linear_v_head_dim, chunk
        per_head = 2 * c * dk * 2 + c * (dv + dk) + 3 * 2 * dk * dv + 2 * c * dv
        return 3 * self.linear_n_v_heads * per_head

    def state_bytes_per_sequence(self, bytes_per_element: int = 4) -> int:
        """The linear layers' recurrent state ([Hv, dk, dv] fp32) and short-convolution window ((K - 1) x conv
        channels) of one sequence, over every linear layer."""
        state = self.linear_n_v_heads * self.linear_k_head_dim * self.linear_v_head_dim
        conv = (self.linear_conv_kernel - 1) * (2 * self.linear_key_dim + self.linear_value_dim)
        return self.n_linear_layers * (state + conv) * bytes_per_element


def build_args(model_cfg: ModelConfig, flavor: str) -> Qwen3NextArgs:
    """[model] resolved into the args of Qwen3-Next / Qwen3.5 `flavor`."""
    preset = dict(FLAVORS[flavor])
    own = {k: preset.pop(k) for k in OWN_FIELDS if k in preset}
    own.update({k: getattr(model_cfg, k) for k in OVERRIDABLE if getattr(model_cfg, k, None) is not None})
    own["capacity_factor"] = own.get("capacity_factor") or None
    own["layer_types"] = own.get("layer_types") or []
    dense = resolve_args(model_cfg, "qwen3_next", {flavor: preset}, flavor)
    return Qwen3NextArgs(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}, **own)


def args_from_dict(fields: dict[str, Any]) -> Qwen3NextArgs:
    """Qwen3NextArgs from a checkpoint's stored fields."""
    known = Qwen3NextArgs.__dataclass_fields__
    return Qwen3NextArgs(**{k: v for k, v in fields.items() if k in known})

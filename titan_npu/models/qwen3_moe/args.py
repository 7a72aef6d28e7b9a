"""Qwen3-MoE's shapes: the dense Qwen3 decoder's (DecoderArgs) plus the MoE fields, the published flavors
(Hugging Face Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json) and their resolution from [model]."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.models.decoder.args import DecoderArgs, resolve_args
from titan_npu.models.moe.args import MoEArgs

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# ModelConfig fields of the MoE part that override a flavor when set.
MOE_OVERRIDABLE = ("n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                   "router_aux_loss_coef", "capacity_factor", "shared_ffn_dim")

_QWEN3 = dict(head_dim=128, qk_norm=True, qkv_bias=False, vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0,
              max_seq_len=40960, tie_embeddings=False)
_MOE: dict[str, Any] = dict(n_experts=128, top_k=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            router_aux_loss_coef=0.001)
FLAVORS: dict[str, dict[str, Any]] = {
    # A tiny Qwen3-MoE for CPU runs and tests: 8 experts, top-2, every layer MoE, the 2,048-token tokenizer.
    "debug": {**_QWEN3, **_MOE, **dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384,
                                       vocab_size=2048, max_seq_len=2048, n_experts=8, top_k=2, moe_ffn_dim=128)},
    "30B-A3B": dict(**_QWEN3, **_MOE, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, moe_ffn_dim=768),
    "235B-A22B": dict(**_QWEN3, **_MOE, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                      moe_ffn_dim=1536),
}


@dataclass
class MoEDecoderArgs(DecoderArgs):
    """A decoder whose feed-forwards are MoE layers, except every layer in mlp_only_layers or off the
    decoder_sparse_step rhythm (those keep the dense ffn_dim SwiGLU)."""

    n_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    capacity_factor: float | None = None  # None = dropless
    shared_ffn_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            raise ConfigError(f"model.decoder_sparse_step={self.decoder_sparse_step!r} must be a positive integer "
                              f"(1 = every layer is MoE)")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"model.mlp_only_layers has {bad}, not layer ids of this {self.n_layers}-layer model "
                              f"(use 0..{self.n_layers - 1})")
        if self.router_aux_loss_coef < 0:
            raise ConfigError(f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (0 = off)")
        self.moe_args()  # validates the MoE shapes

    def moe_args(self) -> MoEArgs:
        """The arguments of this model's MoE layers."""
        return MoEArgs(dim=self.dim, n_experts=self.n_experts, top_k=self.top_k, ffn_dim=self.moe_ffn_dim,
                       norm_topk_prob=self.norm_topk_prob, capacity_factor=self.capacity_factor,
                       shared_ffn_dim=self.shared_ffn_dim)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a MoE feed-forward (transformers' Qwen3MoeDecoderLayer rule)."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @property
    def n_moe_layers(self) -> int:
        """How many layers are MoE."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Every parameter, all experts included."""
        return self._with_moe(super().num_params(exclude_embedding), self.moe_args().total_params())

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """The parameters one token meets: the router, its top_k experts and the shared expert of each MoE layer."""
        return self._with_moe(super().num_params(exclude_embedding), self.moe_args().active_params())

    def _with_moe(self, dense_total: int, per_moe_layer: int) -> int:
        return dense_total + self.n_moe_layers * (per_moe_layer - 3 * self.dim * self.ffn_dim)


def build_args(model_cfg: ModelConfig, flavor: str) -> MoEDecoderArgs:
    """[model] resolved into the args of Qwen3-MoE `flavor`."""
    preset = dict(FLAVORS[flavor])
    moe = {k: preset.pop(k) for k in MOE_OVERRIDABLE if k in preset}
    moe.update({k: getattr(model_cfg, k) for k in MOE_OVERRIDABLE if getattr(model_cfg, k, None) is not None})
    moe["capacity_factor"] = moe.get("capacity_factor") or None  # 0 means dropless, as None does
    dense = resolve_args(model_cfg, "qwen3_moe", {flavor: preset}, flavor)
    return MoEDecoderArgs(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}, **moe)


def args_from_dict(fields: dict[str, Any]) -> MoEDecoderArgs:
    """MoEDecoderArgs from a checkpoint's stored fields."""
    known = MoEDecoderArgs.__dataclass_fields__
    return MoEDecoderArgs(**{k: v for k, v in fields.items() if k in known})

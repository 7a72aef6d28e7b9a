"""The MoE decoder's shapes: the dense decoder's (DecoderArgs) plus the MoE fields, shared by the families whose
feed-forwards are mixture-of-experts layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titan_npu.errors import ConfigError
from titan_npu.models.decoder.args import DECODER_KEYS, DecoderArgs, present_fields
from titan_npu.models.moe.args import MOE_KEYS, MoEArgs

# The [model] keys of the MoE part that override a flavor when set.
MOE_OVERRIDABLE = tuple(MOE_KEYS)
# Every [model] key of a MoE decoder family (qwen3_moe): the dense decoder's, then the MoE ones.
MOE_DECODER_KEYS = {**DECODER_KEYS, **MOE_KEYS}

# The MoE fields `titan-npu import` prints in [model] (those the args have), in this order.
MOE_PRINTED = ("n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
               "router_aux_loss_coef")


def moe_model_lines(args: Any) -> list[tuple[str, Any]]:
    """The [model] keys beyond the decoder's that `titan-npu import` prints for a MoE decoder: its routing."""
    return present_fields(args, MOE_PRINTED)


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

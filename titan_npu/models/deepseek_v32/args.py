"""DeepSeek-V3.2's args: DeepSeek-V3's (MLA, MoE, YaRN) plus DeepSeek Sparse Attention's lightning indexer and the
training stage of the DeepSeek-V3.2 report; the published flavors and their resolution from [model].

Flavors (Hugging Face config.json of each): V3.2-Exp is deepseek-ai/DeepSeek-V3.2-Exp, V3.2 deepseek-ai/DeepSeek-V3.2
(the same shapes: DeepSeek-V3's 671B with index_n_heads 64, index_head_dim 128, index_topk 2048); their
multi-token-prediction layer is set aside on import (mtp_depth 0: the indexer-carrying MTP block is not built);
debug is a tiny model for CPU runs and tests.

Training stages (model.dsa_stage), as the report describes them:
  dense_warmup  attention stays dense; every parameter but the indexers' is frozen (no gradient, no optimizer
                state, the routers' score biases do not move); each indexer learns KL(p || softmax(I)), p the main
                attention's probabilities summed over heads and L1-normalised, over each query's causal keys.
  sparse        attention runs over each query's top index_topk keys of its indexer; the indexer's input is
                detached, so the language-model loss trains the model and only the KL loss, over the selected
                keys, trains the indexer. indexer_loss_weight = 0 freezes the indexers (transformers' training).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.knobs import Knob, off_key, size_key
from titan_npu.models.decoder.args import DecoderArgs, resolve_args
from titan_npu.models.deepseek_v3.args import DEEPSEEK_KEYS, DEEPSEEK_OVERRIDABLE, YARN_FIELDS, DeepSeekArgs
from titan_npu.models.deepseek_v3.args import FLAVORS as V3_FLAVORS

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

DENSE_WARMUP, SPARSE = "dense_warmup", "sparse"
DSA_STAGES = (DENSE_WARMUP, SPARSE)

# DeepSeek-V3's keys (multi-token prediction aside) and the indexer's.
DSA_KEYS: dict[str, Knob] = {
    **{k: v for k, v in DEEPSEEK_KEYS.items() if k not in ("mtp_depth", "mtp_loss_coef")},
    "index_n_heads": size_key(),  # the lightning indexer's heads
    "index_head_dim": size_key(),  # their width (the first qk_rope_head_dim channels rotated)
    "index_topk": size_key(),  # keys each query attends to in the sparse stage (2048 published)
    "dsa_stage": Knob(choices=DSA_STAGES, what="DSA training stage", kind=str),
    "indexer_loss_weight": off_key(),  # weight of the indexer's KL loss; 0 = the indexers frozen
}
DSA_OWN = ("index_n_heads", "index_head_dim", "index_topk", "dsa_stage", "indexer_loss_weight")
OVERRIDABLE = tuple(k for k in DEEPSEEK_OVERRIDABLE if k not in ("mtp_depth", "mtp_loss_coef")) + DSA_OWN

_INDEXER = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)
_PUBLISHED = {k: v for k, v in V3_FLAVORS["671B"].items()} | _INDEXER
FLAVORS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's debug shapes, an indexer of 4 heads of 32 keeping 8 keys per query.
    "debug": {**V3_FLAVORS["debug"], "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8},
    "V3.2-Exp": dict(_PUBLISHED),
    "V3.2": dict(_PUBLISHED),
}


@dataclass
class DSAArgs(DeepSeekArgs):
    """DeepSeek-V3 with a lightning indexer in every layer (q_lora_rank > 0: the indexer's query reads that
    latent); dsa_stage and indexer_loss_weight say how it trains."""

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    dsa_stage: str = SPARSE
    indexer_loss_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")
        if not self.q_lora_rank:
            raise ConfigError("model.q_lora_rank=0: DeepSeek Sparse Attention's indexer reads the query latent; set "
                              "model.q_lora_rank > 0 (1536 published)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"model.index_head_dim={self.index_head_dim} is below model.qk_rope_head_dim="
                              f"{self.qk_rope_head_dim}, the channels the indexer rotates; raise it")
        if self.dsa_stage not in DSA_STAGES:
            raise ConfigError(f"model.dsa_stage={self.dsa_stage!r} is not a DSA training stage (use dense_warmup or "
                              f"sparse)")
        if self.indexer_loss_weight < 0:
            raise ConfigError(f"model.indexer_loss_weight={self.indexer_loss_weight} must be >= 0 (0 = the "
                              f"indexers frozen)")
        if self.dsa_stage == DENSE_WARMUP and not self.indexer_loss_weight:
            raise ConfigError("model.dsa_stage='dense_warmup' trains the indexers alone, by their loss: set "
                              "model.indexer_loss_weight > 0")
        if self.mtp_depth:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth}: DeepSeek-V3.2's multi-token prediction block "
                              f"(with its own indexer) is not built; set model.mtp_depth = 0")

    @property
    def trains_indexer(self) -> bool:
        """Whether the indexers learn (their KL loss is in the optimised loss)."""
        return self.indexer_loss_weight > 0

    def indexer_params(self) -> int:
        """Parameters of one lightning indexer: wq_b, wk, k_norm (weight and bias), weights_proj."""
        return (self.q_lora_rank * self.index_n_heads * self.index_head_dim + self.dim * self.index_head_dim
                + 2 * self.index_head_dim + self.dim * self.index_n_heads)

    def attention_params(self) -> int:
        """MLA's parameters plus its indexer's."""
        return super().attention_params() + self.indexer_params()

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 N plus attention over the keys each query keeps (min(index_topk, seq_len) in the sparse stage) and
        the indexer's scoring of every key (2 x 3 L H_I D_I S, forward and backward)."""
        keys = seq_len if self.dsa_stage == DENSE_WARMUP else min(self.index_topk, seq_len)
        return (6 * self.num_active_params(exclude_embedding=True)
                + 6 * self.n_layers * self.n_heads * keys * (self.head_dim + self.v_head_dim)
                + 6 * self.n_layers * self.index_n_heads * seq_len * self.index_head_dim)


def build_args(model_cfg: ModelConfig, flavor: str) -> DSAArgs:
    """[model] resolved into the args of DeepSeek-V3.2 `flavor`."""
    preset = dict(FLAVORS[flavor])
    own = {k: preset.pop(k) for k in (*OVERRIDABLE, *YARN_FIELDS) if k in preset}
    own.update({k: getattr(model_cfg, k) for k in (*OVERRIDABLE, *YARN_FIELDS)
                if getattr(model_cfg, k, None) is not None})
    own["yarn_factor"] = own.get("yarn_factor") or None  # 0 means plain RoPE, as None does
    dense = resolve_args(model_cfg, "deepseek_v32", {flavor: preset}, flavor)
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}
    return DSAArgs(**fields, **own)


def args_from_dict(fields: dict[str, Any]) -> DSAArgs:
    """DSAArgs from a checkpoint's stored fields."""
    known = DSAArgs.__dataclass_fields__
    return DSAArgs(**{k: v for k, v in fields.items() if k in known})

"""DeepSeek-V3.2's args: DeepSeek-V3's (MLA, MoE, YaRN) plus DeepSeek Sparse Attention's lightning indexer and the
training stage of the DeepSeek-V3.2 report; the published flavors and their resolution from [model]. GLM-5
(Hugging Face glm_moe_dsa) is this family's other variant: the same blocks with the indexer's RoPE on interleaved
pairs and, per layer, its own indexer or the last full layer's selection (indexer_types).

Flavors (Hugging Face config.json of each): V3.2-Exp is deepseek-ai/DeepSeek-V3.2-Exp, V3.2 deepseek-ai/DeepSeek-V3.2
(the same shapes: DeepSeek-V3's 671B with index_n_heads 64, index_head_dim 128, index_topk 2048); their
multi-token-prediction layer is set aside on import (mtp_depth 0: the indexer-carrying MTP block is not built).
GLM-5 is transformers 5.25's GlmMoeDsaConfig defaults, the configuration class of zai-org/GLM-5
(transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py: 78 layers of dim 6144, 64 heads, a 2048-rank query and
512-rank key/value latent, qk 192 + 64, v 256, 256 experts top-8 of 2048 with one shared in one group, the first 3
layers dense, an indexer of 32 heads of 128 keeping 2048 keys in every layer, 202,752 positions, RoPE base 10000 as
that class's default rope_parameters: the checkpoint's config.json, read on import, wins). debug is a tiny model for
CPU runs and tests.

Training stages (model.dsa_stage), as the report describes them:
  dense_warmup  attention stays dense; every parameter but the indexers' is frozen (no gradient, no optimizer
                state, the routers' score biases do not move); each indexer learns KL(p || softmax(I)), p the main
                attention's probabilities summed over heads and L1-normalised, over each query's causal keys.
  sparse        attention runs over each query's top index_topk keys of its indexer; the indexer's input is
                detached, so the language-model loss trains the model and only the KL loss, over the selected
                keys, trains the indexer. indexer_loss_weight = 0 freezes the indexers (transformers' training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_npu.errors import ConfigError
from titan_npu.knobs import Knob, off_key, size_key
from titan_npu.models.deepseek_v3.args import (
    DEEPSEEK_KEYS,
    DEEPSEEK_OVERRIDABLE,
    DeepSeekArgs,
    resolve_deepseek_args,
)
from titan_npu.models.deepseek_v3.args import FLAVORS as V3_FLAVORS

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

DENSE_WARMUP, SPARSE = "dense_warmup", "sparse"
DSA_STAGES = (DENSE_WARMUP, SPARSE)
TARGET_HEADS_AT_ONCE = 16  # the KL target (ops/reference.py head_summed_probs' default) scores so many heads at once
FULL, SHARED = "full", "shared"  # a layer runs its own indexer, or reuses the last full layer's selection (GLM-5)
VARIANTS = ("deepseek_v32", "glm_moe_dsa")  # the Hugging Face layout (hf.py): DeepSeek-V3.2's or GLM-5's

# DeepSeek-V3's keys (multi-token prediction aside) and the indexer's.
DSA_KEYS: dict[str, Knob] = {
    **{k: v for k, v in DEEPSEEK_KEYS.items() if k not in ("mtp_depth", "mtp_loss_coef")},
    "index_n_heads": size_key(),  # the lightning indexer's heads
    "index_head_dim": size_key(),  # their width (the first qk_rope_head_dim channels rotated)
    "index_topk": size_key(),  # keys each query attends to in the sparse stage (2048 published)
    "dsa_stage": Knob(choices=DSA_STAGES, what="DSA training stage", kind=str),
    "indexer_loss_weight": off_key(),  # weight of the indexer's KL loss; 0 = the indexers frozen
    "variant": Knob(choices=VARIANTS, what="Hugging Face layout", kind=str),  # GLM-5: interleaved indexer RoPE
    # Per layer: "full" runs its own indexer, "shared" reuses the last full layer's selection (GLM-5).
    "indexer_types": Knob(choices=(FULL, SHARED), what="indexer type", each=True, kind=list[str]),
}
DSA_OWN = ("index_n_heads", "index_head_dim", "index_topk", "dsa_stage", "indexer_loss_weight", "variant")
OVERRIDABLE = tuple(k for k in DEEPSEEK_OVERRIDABLE if k not in ("mtp_depth", "mtp_loss_coef")) + DSA_OWN + (
    "indexer_types",)

_INDEXER = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)
_PUBLISHED = {k: v for k, v in V3_FLAVORS["671B"].items()} | _INDEXER
FLAVORS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's debug shapes, an indexer of 4 heads of 32 keeping 8 keys per query.
    "debug": {**V3_FLAVORS["debug"], "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8},
    "V3.2-Exp": dict(_PUBLISHED),
    "V3.2": dict(_PUBLISHED),
    "GLM-5": dict(dim=6144, n_layers=78, n_heads=64, vocab_size=154880, ffn_dim=12288, norm_eps=1e-5,
                  rope_theta=10000.0, max_seq_len=202752, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                  qk_rope_head_dim=64, v_head_dim=256, n_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1,
                  n_groups=1, topk_groups=1, route_scale=2.5, norm_topk_prob=True, first_k_dense=3,
                  index_n_heads=32, index_head_dim=128, index_topk=2048, variant="glm_moe_dsa"),
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
    # Per layer, FULL or SHARED (GLM-5's cross-layer sharing of the top-k); None = every layer FULL.
    indexer_types: list[str] | None = None
    variant: str = "deepseek_v32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.indexer_types is not None:
            types = list(self.indexer_types)
            if len(types) != self.n_layers or any(t not in (FULL, SHARED) for t in types) or types[0] != FULL:
                raise ConfigError(f"model.indexer_types={types!r} must give each of the {self.n_layers} layers "
                                  f"'{FULL}' or '{SHARED}', the first '{FULL}' (a shared layer reuses the last full "
                                  f"layer's selection)")
            self.indexer_types = types
            if SHARED in types and self.variant != "glm_moe_dsa":
                raise ConfigError("model.indexer_types shares selections across layers, which only GLM-5's layout "
                                  "(config.json indexer_types) carries; set model.variant = \"glm_moe_dsa\"")
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
        if self.variant not in VARIANTS:
            raise ConfigError(f"model.variant={self.variant!r} is not a DSA layout (use deepseek_v32 or glm_moe_dsa)")
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
    def indexer_rope_interleave(self) -> bool:
        """The indexer's RoPE pairs: interleaved (2i, 2i + 1) for GLM-5, half-split (i, i + r/2) for
        DeepSeek-V3.2."""
        return self.variant == "glm_moe_dsa"

    def has_indexer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` runs its own indexer (else it reuses the last full layer's selection)."""
        return self.indexer_types is None or self.indexer_types[layer_id] == FULL

    def selection_source(self, layer_id: int) -> int:
        """The layer whose indexer selects layer `layer_id`'s keys: itself, or the last full layer before it."""
        return max(i for i in range(layer_id + 1) if self.has_indexer(i))

    @property
    def n_indexers(self) -> int:
        """How many layers run an indexer."""
        return sum(self.has_indexer(i) for i in range(self.n_layers))

    @property
    def trains_indexer(self) -> bool:
        """Whether the indexers learn (their KL loss is in the optimised loss)."""
        return self.indexer_loss_weight > 0

    def trains(self, name: str) -> bool:
        """Whether parameter `name` (or kind) learns: the indexers alone in the dense warm-up; in the sparse stage
        every parameter, the indexers' only while indexer_loss_weight > 0."""
        indexer = "indexer." in name
        return indexer if self.dsa_stage == DENSE_WARMUP else self.trains_indexer or not indexer

    def indexer_params(self) -> int:
        """Parameters of one lightning indexer: wq_b, wk, k_norm (weight and bias), weights_proj."""
        return (self.q_lora_rank * self.index_n_heads * self.index_head_dim + self.dim * self.index_head_dim
                + 2 * self.index_head_dim + self.dim * self.index_n_heads)

    def _count(self, per_moe_layer: int, exclude_embedding: bool) -> int:
        """DeepSeek-V3's count plus the indexers of the layers that have one."""
        return super()._count(per_moe_layer, exclude_embedding) + self.n_indexers * self.indexer_params()

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 N plus attention over the keys each query keeps (min(index_topk, seq_len) in the sparse stage) and
        the indexers' scoring of every key (2 x 3 H_I D_I S per layer with an indexer, forward and backward)."""
        keys = seq_len if self.dsa_stage == DENSE_WARMUP else min(self.index_topk, seq_len)
        return (6 * self.num_active_params(exclude_embedding=True)
                + 6 * self.n_layers * self.n_heads * keys * (self.head_dim + self.v_head_dim)
                + 6 * self.n_indexers * self.index_n_heads * seq_len * self.index_head_dim)


def build_args(model_cfg: ModelConfig, flavor: str) -> DSAArgs:
    """[model] resolved into the args of DeepSeek-V3.2 `flavor`."""
    return resolve_deepseek_args(model_cfg, flavor, FLAVORS, "deepseek_v32", OVERRIDABLE, DSAArgs)


def args_from_dict(fields: dict[str, Any]) -> DSAArgs:
    """DSAArgs from a checkpoint's stored fields."""
    known = DSAArgs.__dataclass_fields__
    return DSAArgs(**{k: v for k, v in fields.items() if k in known})

"""Qwen3-MoE's shapes: the MoE decoder's (MoEDecoderArgs), the published flavors (Hugging Face
Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json) and their resolution from [model]."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from titan_npu.models.decoder.args import DecoderArgs, resolve_args
from titan_npu.models.moe_decoder.args import MOE_OVERRIDABLE, MoEDecoderArgs

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

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

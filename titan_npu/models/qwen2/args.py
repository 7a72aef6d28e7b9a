"""Qwen2.5 dense flavors: the published shapes (Hugging Face Qwen/Qwen2.5-*), and their resolution from the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_npu.models.decoder.args import DecoderArgs, resolve_args

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# Every Qwen2.5 model: biases on q/k/v, RoPE base 1e6, a 32,768-position context; the three smallest use a
# 151,936-token vocabulary and tie the output projection to the embedding, the others 152,064 untied.
_QWEN2 = dict(qkv_bias=True, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768)
_SMALL = dict(_QWEN2, vocab_size=151936, tie_embeddings=True)
_LARGE = dict(_QWEN2, vocab_size=152064)
FLAVORS: dict[str, dict[str, Any]] = {
    # A few-million-parameter Qwen2 for CPU runs and tests: GQA 4:1, tied, the project's 2,048-token tokenizer.
    "debug": dict(_SMALL, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768, vocab_size=2048,
                  max_seq_len=2048),
    "0.5B": dict(_SMALL, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864),
    "1.5B": dict(_SMALL, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960),
    "3B": dict(_SMALL, dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008),
    "7B": dict(_LARGE, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944),
    "14B": dict(_LARGE, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=13824),
    "32B": dict(_LARGE, dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648),
    "72B": dict(_LARGE, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=29568),
}


def build_args(model_cfg: ModelConfig, flavor: str) -> DecoderArgs:
    """[model] resolved into the args of Qwen2.5 `flavor`."""
    return resolve_args(model_cfg, "qwen2", FLAVORS, flavor)

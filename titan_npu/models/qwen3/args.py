"""Qwen3 dense flavors: the published shapes (Hugging Face Qwen/Qwen3-*), and their resolution from the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_npu.models.decoder.args import DecoderArgs, resolve_args

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# Every Qwen3 model: head size 128 whatever the width, q/k norms, no biases, a 151,936-token vocabulary, RoPE base
# 1e6, a 40,960-position context. The three smallest tie the output projection to the embedding.
_QWEN3 = dict(head_dim=128, qk_norm=True, qkv_bias=False, vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0,
              max_seq_len=40960)
FLAVORS: dict[str, dict[str, Any]] = {
    # A few-million-parameter Qwen3 for CPU runs and tests: head size 64 with dim 256 / 8 heads (not dim / n_heads),
    # GQA 2:1, tied, the project's 2,048-token tokenizer.
    "debug": dict(_QWEN3, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=768, vocab_size=2048,
                  max_seq_len=2048, tie_embeddings=True),
    "0.6B": dict(_QWEN3, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True),
    "1.7B": dict(_QWEN3, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True),
    "4B": dict(_QWEN3, dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True),
    "8B": dict(_QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
    "14B": dict(_QWEN3, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
    "32B": dict(_QWEN3, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600),
}


def build_args(model_cfg: ModelConfig, flavor: str) -> DecoderArgs:
    """[model] resolved into the args of Qwen3 `flavor`."""
    return resolve_args(model_cfg, "qwen3", FLAVORS, flavor)

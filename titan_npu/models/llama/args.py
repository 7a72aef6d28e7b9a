"""Llama 2 / Llama 3 / 3.1 / 3.2 flavors (Meta's published shapes) and their resolution from the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_npu.models.decoder.args import DecoderArgs, ffn_hidden_dim, resolve_args

if TYPE_CHECKING:
    from titan_npu.config.schema import ModelConfig

# Llama's args are the dense decoder's (the name stays for callers that build a Llama directly).
LlamaArgs = DecoderArgs

# Preset fields use the names of config.schema.ModelConfig; the SwiGLU hidden size follows Meta's rule
# (ffn_hidden_dim) from dim, ffn_dim_multiplier and multiple_of unless ffn_dim is given explicitly. Presets
# without n_kv_heads are multi-head attention: n_kv_heads follows n_heads, also when n_heads is overridden.
_LLAMA2_7B = dict(dim=4096, n_layers=32, n_heads=32, multiple_of=256, ffn_dim_multiplier=None)
_LLAMA3 = dict(vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192)
# Llama 3.1 and 3.2: the same shapes with the long-context RoPE frequency scaling and a 128k context.
_LLAMA31 = dict(_LLAMA3, rope_scaling_factor=8.0, max_seq_len=131072)
_LLAMA32 = dict(_LLAMA3, rope_scaling_factor=32.0, max_seq_len=131072, tie_embeddings=True)
_LLAMA3_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3)
_LLAMA3_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3)
_LLAMA3_405B = dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.2)
FLAVORS: dict[str, dict[str, dict[str, Any]]] = {
    "llama2": {
        "debug": dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=2048),
        "7B": dict(_LLAMA2_7B, vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
        "13B": dict(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256,
                    ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
        "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, multiple_of=4096,
                    ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
    },
    "llama3": {
        "debug": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=2048),
        # Llama 3.2 1B and 3B: the output projection is the embedding (tied), RoPE scaled by 32.
        "1B": dict(_LLAMA32, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256,
                   ffn_dim_multiplier=1.5),
        "3B": dict(_LLAMA32, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
        # Llama 2 7B shapes (multi-head attention, FFN 11008) with Llama 3's vocabulary and RoPE base.
        "7B": dict(_LLAMA2_7B, **_LLAMA3),
        "8B": dict(_LLAMA3_8B, **_LLAMA3),
        "70B": dict(_LLAMA3_70B, **_LLAMA3),
        "405B": dict(_LLAMA3_405B, **_LLAMA3),
        "3.1-8B": dict(_LLAMA3_8B, **_LLAMA31),
        "3.1-70B": dict(_LLAMA3_70B, **_LLAMA31),
        "3.1-405B": dict(_LLAMA3_405B, **_LLAMA31),
    },
}


def build_args(model_cfg: ModelConfig, family: str, flavor: str) -> DecoderArgs:
    """[model] resolved into the args of a Llama `family` ('llama2' / 'llama3') `flavor`."""
    return resolve_args(model_cfg, family, FLAVORS[family], flavor)


def llama3_flavor(version: str | None, size: str | None) -> str | None:
    """The llama3 flavor a name's version and size mean: 'llama3.1_8b' -> '3.1-8B', 'llama3.2_1b' -> '1B'."""
    if size is None or version in (None, "0", "2"):
        return size
    return f"3.{version}-{size}"


__all__ = ["FLAVORS", "LlamaArgs", "build_args", "ffn_hidden_dim", "llama3_flavor"]

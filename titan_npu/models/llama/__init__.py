"""Llama 2 / Llama 3 (3.1, 3.2): flavors, config.json and Meta checkpoint mapping; the model is the dense decoder."""

from titan_npu.models.decoder.hf import from_hf, to_hf
from titan_npu.models.decoder.model import Transformer, precompute_rope
from titan_npu.models.llama.args import FLAVORS, LlamaArgs, ffn_hidden_dim
from titan_npu.models.llama.hf import args_from_hf_config, hf_config
from titan_npu.models.llama.meta import from_meta

__all__ = [
    "FLAVORS",
    "LlamaArgs",
    "Transformer",
    "args_from_hf_config",
    "ffn_hidden_dim",
    "from_hf",
    "from_meta",
    "hf_config",
    "precompute_rope",
    "to_hf",
]

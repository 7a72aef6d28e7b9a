"""Llama 2 / Llama 3 (3.1, 3.2): flavors, config.json and Meta checkpoint mapping; the model is the dense decoder."""

from titan_npu.models.decoder.model import Transformer, precompute_rope
from titan_npu.models.llama.args import FLAVORS, LlamaArgs, ffn_hidden_dim
from titan_npu.models.llama.state_dict_adapter import args_from_hf_config, from_hf, from_meta, hf_config, to_hf

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

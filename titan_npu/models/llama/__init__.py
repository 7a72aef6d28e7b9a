"""Llama 2 / Llama 3: arguments and flavors, the model, and the Hugging Face / Meta weight mapping."""

from titan_npu.models.llama.args import FLAVORS, LlamaArgs, build_model_args, ffn_hidden_dim
from titan_npu.models.llama.model import Transformer, precompute_rope
from titan_npu.models.llama.state_dict_adapter import args_from_hf_config, from_hf, from_meta, hf_config, to_hf

__all__ = [
    "FLAVORS",
    "LlamaArgs",
    "Transformer",
    "args_from_hf_config",
    "build_model_args",
    "ffn_hidden_dim",
    "from_hf",
    "from_meta",
    "hf_config",
    "precompute_rope",
    "to_hf",
]

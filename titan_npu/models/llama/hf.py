"""Llama's Hugging Face config (LlamaForCausalLM); the weights map through the dense decoder's Hugging Face mapping
(models/decoder/hf.py: wq/wk rows permuted between HF's rotate-half RoPE layout and Meta's interleaved one)."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder import hf as decoder_hf
from titan_npu.models.decoder.args import DecoderArgs, matching_flavor
from titan_npu.models.llama.args import FLAVORS


def hf_config(args: DecoderArgs) -> dict[str, Any]:
    """config.json for a Hugging Face LlamaForCausalLM with these shapes (tokenizer ids and dtype are the caller's)."""
    return {**decoder_hf.hf_config(args, "llama", "LlamaForCausalLM"), "mlp_bias": False}


def args_from_hf_config(config: dict[str, Any]) -> DecoderArgs:
    """Llama's args from a Hugging Face Llama config.json; Llama 3 by its vocabulary or RoPE base, else Llama 2."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    family = "llama3" if config.get("vocab_size", 0) >= 128000 or rope_theta >= 500000 else "llama2"
    args = decoder_hf.args_from_hf_config(config, model_type="llama", family=family)
    args.flavor = matching_flavor(args, FLAVORS[family])
    return args

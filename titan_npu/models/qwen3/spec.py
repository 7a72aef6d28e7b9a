"""Qwen3 dense's registry entry (model.name = "qwen3"; Hugging Face model_type "qwen3")."""

from __future__ import annotations

import re
from typing import Any

from titan_npu.models.decoder import hf
from titan_npu.models.decoder.args import DECODER_KEYS, DecoderArgs, matching_flavor
from titan_npu.models.decoder.parts import decoder_hf_adapter, decoder_parts
from titan_npu.models.qwen3.args import FLAVORS, build_args
from titan_npu.models.spec import ModelSpec


def args_from_hf_config(config: dict[str, Any]) -> DecoderArgs:
    """Qwen3's args from a Hugging Face Qwen3ForCausalLM config.json."""
    args = hf.args_from_hf_config(config, model_type="qwen3", family="qwen3", qk_norm=True)
    args.flavor = matching_flavor(args, FLAVORS)
    return args


def hf_config(args: DecoderArgs) -> dict[str, Any]:
    """config.json of a Hugging Face Qwen3ForCausalLM with these shapes."""
    return {**hf.hf_config(args, "qwen3", "Qwen3ForCausalLM"), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": args.n_layers}


QWEN3 = ModelSpec(
    name="qwen3",
    description="Qwen3 dense (0.6B, 1.7B, 4B, 8B, 14B, 32B)",
    flavors=FLAVORS,
    # "qwen3", "qwen3_8b", "qwen-3-0.6b".
    name_pattern=re.compile(r"qwen[-_ ]?3(?:[-_ ](?P<size>\d+(?:\.\d+)?)b)?", re.IGNORECASE),
    model_keys=DECODER_KEYS,
    build_args=build_args,
    hf=decoder_hf_adapter(("qwen3",), args_from_hf_config, hf_config),
    **decoder_parts(),
)

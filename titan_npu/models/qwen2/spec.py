"""Qwen2 / Qwen2.5 dense's registry entry (model.name = "qwen2"; Hugging Face model_type "qwen2")."""

from __future__ import annotations

import re
from typing import Any

from titan_npu.models.decoder import hf
from titan_npu.models.decoder.args import DECODER_KEYS, DecoderArgs, matching_flavor
from titan_npu.models.decoder.parts import decoder_hf_adapter, decoder_parts
from titan_npu.models.qwen2.args import FLAVORS, build_args
from titan_npu.models.spec import ModelSpec


def args_from_hf_config(config: dict[str, Any]) -> DecoderArgs:
    """Qwen2's args from a Hugging Face Qwen2ForCausalLM config.json (its q/k/v projections always have biases)."""
    args = hf.args_from_hf_config(config, model_type="qwen2", family="qwen2", qkv_bias=True)
    args.flavor = matching_flavor(args, FLAVORS)
    return args


def hf_config(args: DecoderArgs) -> dict[str, Any]:
    """config.json of a Hugging Face Qwen2ForCausalLM with these shapes."""
    config = hf.hf_config(args, "qwen2", "Qwen2ForCausalLM")
    del config["attention_bias"]  # Qwen2's attention always has q/k/v biases; the config has no such field
    return {**config, "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}


QWEN2 = ModelSpec(
    name="qwen2",
    description="Qwen2 / Qwen2.5 dense (0.5B, 1.5B, 3B, 7B, 14B, 32B, 72B)",
    flavors=FLAVORS,
    # "qwen2", "qwen2.5", "qwen2.5_7b", "qwen2-72b".
    name_pattern=re.compile(r"qwen[-_ ]?2(?:\.5)?(?:[-_ ](?P<size>\d+(?:\.\d+)?)b)?", re.IGNORECASE),
    model_keys=DECODER_KEYS,
    build_args=build_args,
    hf=decoder_hf_adapter(("qwen2",), args_from_hf_config, hf_config),
    **decoder_parts(),
)

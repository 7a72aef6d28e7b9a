"""The Llama families' registry entries: Llama 2 and Llama 3 (3.1, 3.2) on the dense decoder."""

from __future__ import annotations

import re

from titan_npu.models.decoder.args import DECODER_KEYS
from titan_npu.models.decoder.parts import decoder_hf_adapter, decoder_parts
from titan_npu.models.llama.args import FLAVORS, build_args, llama3_flavor
from titan_npu.models.llama.hf import args_from_hf_config, hf_config
from titan_npu.models.llama.meta import read_meta
from titan_npu.models.spec import ModelSpec

# One reader for both: config.json says model_type "llama", and the vocabulary or RoPE base tells 2 from 3.
_HF = decoder_hf_adapter(("llama",), args_from_hf_config, hf_config)

LLAMA2 = ModelSpec(
    name="llama2",
    description="Llama 2 (7B, 13B, 70B)",
    flavors=FLAVORS["llama2"],
    # "llama", "llama2", "llama-2", "llama2_7b": a bare "llama" is Llama 2, as in the guides.
    name_pattern=re.compile(r"llama(?:[-_ ]?2)?(?:[-_ ](?P<size>\d+)b)?", re.IGNORECASE),
    model_keys=DECODER_KEYS,
    build_args=lambda model_cfg, flavor: build_args(model_cfg, "llama2", flavor),
    hf=_HF,
    read_meta=read_meta,
    published_sizes={(4096, 32): "7B", (5120, 40): "13B", (8192, 80): "70B"},
    **decoder_parts(),
)

LLAMA3 = ModelSpec(
    name="llama3",
    description="Llama 3, 3.1 and 3.2 (1B, 3B, 8B, 70B, 405B)",
    flavors=FLAVORS["llama3"],
    # "llama3", "llama3_8b", "llama3.1_70b" (-> 3.1-70B), "llama-3.2-1b" (-> 1B).
    name_pattern=re.compile(r"llama[-_ ]?3(?:\.(?P<version>\d))?(?:[-_ ](?P<size>\d+)b)?", re.IGNORECASE),
    model_keys=DECODER_KEYS,
    build_args=lambda model_cfg, flavor: build_args(model_cfg, "llama3", flavor),
    hf=_HF,
    read_meta=read_meta,
    published_sizes={(4096, 32): "8B", (8192, 80): "70B", (16384, 126): "405B"},
    versioned_flavor=llama3_flavor,
    **decoder_parts(),
)

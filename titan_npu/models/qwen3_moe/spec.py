"""Qwen3-MoE's registry entry (model.name = "qwen3_moe"; Hugging Face model_type "qwen3_moe")."""

from __future__ import annotations

import re

from titan_npu.models.decoder import hf as decoder_hf
from titan_npu.models.decoder.parts import permuted_block
from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.moe.balanced_routing import balanced_routing
from titan_npu.models.moe.cost import MOE_EXPERTS, moe_block_costs
from titan_npu.models.moe_decoder.args import MOE_DECODER_KEYS, moe_model_lines
from titan_npu.models.moe_decoder.model import MoETransformer
from titan_npu.models.moe_decoder.parallelize import parallelize_moe
from titan_npu.models.moe_decoder.sharding import parameter_kinds
from titan_npu.models.qwen3_moe import hf
from titan_npu.models.qwen3_moe.args import FLAVORS, args_from_dict, build_args
from titan_npu.models.spec import HFAdapter, ModelSpec

QWEN3_MOE = ModelSpec(
    name="qwen3_moe",
    description="Qwen3 mixture of experts (30B-A3B, 235B-A22B)",
    flavors=FLAVORS,
    # "qwen3_moe", "qwen3-moe"; a total-active size names the flavor: "qwen3_moe_30b_a3b", "qwen3_30b_a3b".
    name_pattern=re.compile(
        r"qwen[-_ ]?3(?=[-_ ](?:moe|\d+b[-_ ]a\d+b))(?:[-_ ]moe)?(?:[-_ ](?P<version>\d+b[-_ ]a\d+b))?", re.IGNORECASE),
    versioned_flavor=lambda version, size: None if version is None else re.sub(r"[_ ]", "-", version),
    model_keys=MOE_DECODER_KEYS,
    build_args=build_args,
    build_model=MoETransformer,
    parallelize=parallelize_moe,
    split_layers=split_layers,
    build_stage=build_stage,
    parameter_kinds=parameter_kinds,
    block_costs=moe_block_costs,
    model_lines=moe_model_lines,
    hf=HFAdapter(model_types=("qwen3_moe",), args_from_config=hf.args_from_hf_config, config=hf.hf_config,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, hf_name=hf.hf_name, from_hf_layout=decoder_hf.from_hf_layout,
                 permuted_block=permuted_block, stacked_names=hf.stacked_names),
    args_from_dict=args_from_dict,
    balanced_routing=balanced_routing,
    experts=MOE_EXPERTS,
)

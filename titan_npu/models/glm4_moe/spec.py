"""GLM-4.5's registry entry (model.name = "glm4_moe"; Hugging Face model_type "glm4_moe")."""

from __future__ import annotations

import re

from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.glm4_moe import cost, hf
from titan_npu.models.glm4_moe.args import FLAVORS, GLM4_MOE_KEYS, args_from_dict, build_args
from titan_npu.models.glm4_moe.model import Glm4MoeTransformer
from titan_npu.models.moe.balance import update_score_bias
from titan_npu.models.moe.balanced_routing import balanced_routing
from titan_npu.models.moe.cost import MOE_EXPERTS
from titan_npu.models.moe_decoder.parallelize import parallelize_moe
from titan_npu.models.moe_decoder.sharding import parameter_kinds
from titan_npu.models.spec import HFAdapter, ModelSpec

GLM4_MOE = ModelSpec(
    name="glm4_moe",
    description="GLM-4.5 (partial RoPE, sigmoid group-limited MoE; 4.5 355B-A32B, 4.5-Air 106B-A12B)",
    flavors=FLAVORS,
    # "glm4_moe", "glm4-moe"; a version names the flavor: "glm-4.5", "glm4_5" (4.5), "glm-4.5-air", "glm4_5_air".
    name_pattern=re.compile(r"glm[-_ ]?4(?:[-_ ]moe|(?P<version>[-_.]5(?:[-_ ]air)?))", re.IGNORECASE),
    versioned_flavor=lambda version, size: None if version is None else "4.5-air" if "air" in version.lower()
    else "4.5",
    model_keys=GLM4_MOE_KEYS,
    build_args=build_args,
    build_model=Glm4MoeTransformer,
    parallelize=parallelize_moe,
    split_layers=split_layers,
    build_stage=build_stage,
    parameter_kinds=parameter_kinds,
    block_costs=cost.block_costs,
    model_lines=cost.model_lines,
    bias_update_rate=lambda args: args.score_bias_rate,
    hf=HFAdapter(model_types=("glm4_moe",), args_from_config=hf.args_from_hf_config, config=hf.hf_config,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, hf_name=hf.hf_name, from_hf_layout=hf.from_hf_layout,
                 stacked_names=hf.stacked_names),
    args_from_dict=args_from_dict,
    balanced_routing=balanced_routing,
    experts=MOE_EXPERTS,
    update_score_bias=update_score_bias,
)

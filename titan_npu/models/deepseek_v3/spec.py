"""DeepSeek-V3's registry entry (model.name = "deepseek_v3"; Hugging Face model_type "deepseek_v3")."""

from __future__ import annotations

import re

from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.deepseek_v3 import cost, hf
from titan_npu.models.deepseek_v3.args import DEEPSEEK_KEYS, FLAVORS, args_from_dict, build_args
from titan_npu.models.deepseek_v3.model import DeepSeekTransformer
from titan_npu.models.deepseek_v3.parallelize import check_deepseek_layout, parallelize_deepseek
from titan_npu.models.deepseek_v3.sharding import parameter_kinds
from titan_npu.models.moe.balance import update_score_bias
from titan_npu.models.moe.balanced_routing import balanced_routing
from titan_npu.models.moe.cost import MOE_EXPERTS
from titan_npu.models.spec import HFAdapter, ModelSpec

DEEPSEEK_V3 = ModelSpec(
    name="deepseek_v3",
    description="DeepSeek-V3 (MLA, sigmoid group-limited MoE; 16B, 236B, 671B; Kimi K2 1T)",
    flavors=FLAVORS,
    # "deepseek_v3", "deepseek-v3", "deepseekv3"; a size names the flavor: "deepseek_v3_671b"; "kimi_k2", "kimi-k2"
    # name the Kimi K2 flavor.
    name_pattern=re.compile(r"deepseek[-_ ]?v3(?:[-_ ](?P<size>16|236|671)b)?|(?P<version>kimi[-_ ]?k2)",
                            re.IGNORECASE),
    versioned_flavor=lambda version, size: size if version is None else "kimi-k2",
    model_keys=DEEPSEEK_KEYS,
    build_args=build_args,
    build_model=DeepSeekTransformer,
    parallelize=parallelize_deepseek,
    split_layers=split_layers,
    build_stage=build_stage,
    parameter_kinds=parameter_kinds,
    block_costs=cost.block_costs,
    training_flops=cost.training_flops,
    model_lines=cost.model_lines,
    bias_update_rate=lambda args: args.score_bias_rate,
    extra_blocks=lambda args: (args.mtp_depth, "mtp_depth"),
    hf=HFAdapter(model_types=("deepseek_v3", "kimi_k2"), args_from_config=hf.args_from_hf_config, config=hf.hf_config,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, hf_name=hf.hf_name, from_hf_layout=hf.from_hf_layout,
                 stacked_names=hf.stacked_names, held_model=hf.held_model),
    args_from_dict=args_from_dict,
    balanced_routing=balanced_routing,
    experts=MOE_EXPERTS,
    check_layout=check_deepseek_layout,
    update_score_bias=update_score_bias,
)

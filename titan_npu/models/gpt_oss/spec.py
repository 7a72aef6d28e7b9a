"""gpt-oss's registry entry (model.name = "gpt_oss"; Hugging Face model_type "gpt_oss")."""

from __future__ import annotations

import re

from titan_npu.models.decoder import hf as decoder_hf
from titan_npu.models.decoder.parts import permuted_block
from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.gpt_oss import cost, hf
from titan_npu.models.gpt_oss.args import FLAVORS, GPT_OSS_KEYS, args_from_dict, build_args
from titan_npu.models.gpt_oss.model import GptOssTransformer
from titan_npu.models.gpt_oss.parallelize import check_gpt_oss_layout, parallelize_gpt_oss
from titan_npu.models.gpt_oss.sharding import parameter_kinds
from titan_npu.models.moe.balanced_routing import balanced_routing
from titan_npu.models.moe.cost import MOE_EXPERTS
from titan_npu.models.spec import HFAdapter, ModelSpec

GPT_OSS = ModelSpec(
    name="gpt_oss",
    description="gpt-oss (attention sinks, sliding windows, MoE; 20B, 120B)",
    flavors=FLAVORS,
    # "gpt_oss", "gpt-oss", "gptoss"; a size names the flavor: "gpt-oss-20b", "gpt_oss_120b".
    name_pattern=re.compile(r"gpt[-_ ]?oss(?:[-_ ](?P<size>20|120)b)?", re.IGNORECASE),
    model_keys=GPT_OSS_KEYS,
    build_args=build_args,
    build_model=GptOssTransformer,
    parallelize=parallelize_gpt_oss,
    split_layers=split_layers,
    build_stage=build_stage,
    parameter_kinds=parameter_kinds,
    block_costs=cost.block_costs,
    training_flops=cost.training_flops,
    model_lines=cost.model_lines,
    hf=HFAdapter(model_types=("gpt_oss",), args_from_config=hf.args_from_hf_config, config=hf.hf_config,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, hf_name=hf.hf_name, from_hf_layout=decoder_hf.from_hf_layout,
                 permuted_block=permuted_block, shard_wise=False),
    args_from_dict=args_from_dict,
    check_layout=check_gpt_oss_layout,
    balanced_routing=balanced_routing,
    experts=MOE_EXPERTS,
)

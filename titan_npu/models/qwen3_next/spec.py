"""Qwen3-Next / Qwen3.5's registry entry (model.name = "qwen3_next"; Hugging Face model_type "qwen3_next",
"qwen3_5" / "qwen3_5_text" (dense) and "qwen3_5_moe" / "qwen3_5_moe_text")."""

from __future__ import annotations

import re

from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.moe.balanced_routing import balanced_routing
from titan_npu.models.moe.cost import MOE_EXPERTS
from titan_npu.models.qwen3_next import cost, hf
from titan_npu.models.qwen3_next.args import FLAVORS, QWEN3_NEXT_KEYS, args_from_dict, build_args
from titan_npu.models.qwen3_next.model import Qwen3NextTransformer
from titan_npu.models.qwen3_next.parallelize import check_qwen3_next_layout, parallelize_qwen3_next
from titan_npu.models.qwen3_next.sharding import holds_kind, parameter_kinds
from titan_npu.models.spec import HFAdapter, ModelSpec

QWEN3_NEXT = ModelSpec(
    name="qwen3_next",
    description="Qwen3-Next / Qwen3.5 hybrid gated DeltaNet (80B-A3B; 3.5: 9B, 35B-A3B, 397B-A17B)",
    flavors=FLAVORS,
    # "qwen3_next", "qwen3-next", "qwen3next", "qwen3.5", "qwen3_5": model.flavor names the size.
    name_pattern=re.compile(r"qwen[-_ ]?3(?:[-_ ]?next|[._]5)", re.IGNORECASE),
    model_keys=QWEN3_NEXT_KEYS,
    build_args=build_args,
    build_model=Qwen3NextTransformer,
    parallelize=parallelize_qwen3_next,
    split_layers=split_layers,
    build_stage=build_stage,
    parameter_kinds=parameter_kinds,
    block_costs=cost.block_costs,
    training_flops=cost.training_flops,
    model_lines=cost.model_lines,
    generate_refusal=cost.generate_refusal,
    layer_holds=holds_kind,
    hf=HFAdapter(model_types=hf.MODEL_TYPES, args_from_config=hf.args_from_hf_config, config=hf.hf_config,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, hf_name=hf.hf_name,
                 from_hf_layout=lambda name, tensor, args: tensor, shard_wise=False),
    args_from_dict=args_from_dict,
    check_layout=check_qwen3_next_layout,
    balanced_routing=balanced_routing,
    experts=MOE_EXPERTS,
)

"""DeepSeek-V3.2's registry entry (model.name = "deepseek_v32"; Hugging Face model_type "deepseek_v32", and
"glm_moe_dsa" for GLM-5, its other variant)."""

from __future__ import annotations

import re

from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.deepseek_v3 import hf as v3_hf
from titan_npu.models.deepseek_v32 import cost, hf
from titan_npu.models.deepseek_v32.args import DENSE_WARMUP, DSA_KEYS, FLAVORS, args_from_dict, build_args
from titan_npu.models.deepseek_v32.model import DSATransformer
from titan_npu.models.deepseek_v32.parallelize import check_dsa_layout, parallelize_dsa
from titan_npu.models.deepseek_v32.sharding import holds_kind, parameter_kinds
from titan_npu.models.moe.balance import update_score_bias
from titan_npu.models.moe.balanced_routing import balanced_routing
from titan_npu.models.moe.cost import MOE_EXPERTS
from titan_npu.models.spec import HFAdapter, ModelSpec

DEEPSEEK_V32 = ModelSpec(
    name="deepseek_v32",
    description="DeepSeek-V3.2 / GLM-5 (MLA with DeepSeek Sparse Attention, sigmoid MoE; V3.2-Exp, V3.2, GLM-5)",
    flavors=FLAVORS,
    # "deepseek_v32", "deepseek-v3.2", "DeepSeek-V3.2-Exp" (the -exp suffix names that flavor); GLM-5 by its
    # Hugging Face name "glm_moe_dsa" or "glm5" / "glm-5" (model.flavor names the size).
    name_pattern=re.compile(r"deepseek[-_ ]?v3(?:\.|_)?2(?P<version>[-_ ]exp)?|glm[-_ ]?(?:moe[-_ ]?dsa|5)",
                            re.IGNORECASE),
    versioned_flavor=lambda version, size: "V3.2-Exp" if version else size,
    model_keys=DSA_KEYS,
    build_args=build_args,
    build_model=DSATransformer,
    parallelize=parallelize_dsa,
    split_layers=split_layers,
    build_stage=build_stage,
    parameter_kinds=parameter_kinds,
    layer_holds=holds_kind,
    block_costs=cost.block_costs,
    training_flops=cost.training_flops,
    model_lines=cost.model_lines,
    # The dense warm-up freezes the model: the routers' score biases stay too.
    bias_update_rate=lambda args: 0.0 if args.dsa_stage == DENSE_WARMUP else args.score_bias_rate,
    hf=HFAdapter(model_types=hf.MODEL_TYPES, args_from_config=hf.args_from_hf_config, config=hf.hf_config,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, hf_name=hf.hf_name, from_hf_layout=hf.from_hf_layout,
                 stacked_names=v3_hf.stacked_names),
    args_from_dict=args_from_dict,
    balanced_routing=balanced_routing,
    experts=MOE_EXPERTS,
    trains_kind=lambda args, kind: args.trains(kind),  # the dense warm-up trains the indexers alone
    check_layout=check_dsa_layout,
    update_score_bias=update_score_bias,
    generate_refusal=lambda args: ("generate has no cached decoding for deepseek_v32 (its multi-head latent "
                                   "attention and lightning indexer keep no key cache here); export it (--format "
                                   "hf) and generate with transformers"),
)

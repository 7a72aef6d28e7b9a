"""gpt-oss weights and config between ours and Hugging Face's (GptOssForCausalLM).

Embedding, norms, q/k/v (q/k rows permuted into HF's RoPE layout) and the output map as the dense decoder's
(models/decoder/hf.py); the rest of each layer N:
  layers.N.attention.wo.bias                  <-> model.layers.N.self_attn.o_proj.bias
  layers.N.attention.sinks                    <-> model.layers.N.self_attn.sinks
  layers.N.feed_forward.router.gate.{weight,bias} <-> model.layers.N.mlp.router.{weight,bias}
  layers.N.feed_forward.experts.w1 / w3 [E, ffn, dim] <-> model.layers.N.mlp.experts.gate_up_proj [E, dim, 2 ffn],
      its columns interleaved: gate (w1) the even ones, up (w3) the odd ones; b1 / b3 likewise from gate_up_proj_bias
  layers.N.feed_forward.experts.w2 [E, dim, ffn] <-> model.layers.N.mlp.experts.down_proj [E, ffn, dim] (transposed),
      b2 <-> down_proj_bias
The published checkpoints hold gate_up_proj and down_proj as MXFP4 (`_blocks` + `_scales`): they are dequantised on
import (mxfp4.py). Export writes them unquantised (fp32 / bf16), which transformers loads as they are.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder import hf
from titan_npu.models.decoder.args import matching_flavor
from titan_npu.models.gpt_oss.args import FLAVORS, FULL, OWN_FIELDS, SLIDING, GptOssArgs
from titan_npu.models.gpt_oss.mxfp4 import dequantize_mxfp4

StateDict = dict[str, torch.Tensor]

# Ours after "layers.N." -> Hugging Face's after "model.layers.N.", beyond the dense decoder's.
OWN_PER_LAYER = {
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
}
_OWN_FROM_HF = {v: k for k, v in OWN_PER_LAYER.items()}
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.([wb][123])")
_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
QUANT_METHODS = ("mxfp4",)


def hf_name(key: str) -> str:
    """Our parameter name -> its Hugging Face name (a CheckpointError for the experts, which HF holds fused)."""
    match = hf.OUR_LAYER_KEY.fullmatch(key)
    if match is not None and match.group(2) in OWN_PER_LAYER:
        return f"model.layers.{match.group(1)}.{OWN_PER_LAYER[match.group(2)]}"
    if _OUR_EXPERTS.fullmatch(key):
        raise CheckpointError(f"'{key}' is a slice of a fused Hugging Face expert tensor (gate_up_proj interleaves "
                              f"gate and up; down_proj is transposed); it is read with the whole tensor")
    return hf.hf_name(key)


def to_hf(state_dict: StateDict, args: GptOssArgs) -> StateDict:
    """Our state dict -> Hugging Face's names and layouts (experts fused and interleaved, unquantised)."""
    dense, out = {}, {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = hf.OUR_LAYER_KEY.fullmatch(key)
        if (expert := _OUR_EXPERTS.fullmatch(key)) is not None:
            experts.setdefault(expert.group(1), {})[expert.group(2)] = tensor
        elif match is not None and match.group(2) in OWN_PER_LAYER:
            out[hf_name(key)] = tensor
        else:
            dense[key] = tensor
    for layer, t in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack((t["w1"], t["w3"]), dim=2).flatten(1, 2).transpose(1, 2)
        out[f"{prefix}.gate_up_proj_bias"] = torch.stack((t["b1"], t["b3"]), dim=2).flatten(1, 2)
        out[f"{prefix}.down_proj"] = t["w2"].transpose(1, 2)
        out[f"{prefix}.down_proj_bias"] = t["b2"]
    return {**hf.to_hf(dense, args), **out}


def from_hf(hf_state_dict: StateDict, args: GptOssArgs, *, tie_word_embeddings: bool = False) -> StateDict:
    """A Hugging Face state dict (experts unquantised or MXFP4) -> ours."""
    dense, ours = {}, {}
    experts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in hf_state_dict.items():
        match = hf.HF_LAYER_KEY.fullmatch(key)
        if (expert := _HF_EXPERTS.fullmatch(key)) is not None:
            experts.setdefault((expert.group(1), expert.group(2)), {})[expert.group(3) or ""] = tensor
        elif match is not None and match.group(2) in _OWN_FROM_HF:
            ours[f"layers.{match.group(1)}.{_OWN_FROM_HF[match.group(2)]}"] = tensor
        else:
            dense[key] = tensor
    for (layer, proj), parts in experts.items():
        prefix = f"layers.{layer}.feed_forward.experts"
        weight = _expert_weight(parts, f"model.layers.{layer}.mlp.experts.{proj}")
        bias = parts.get("_bias")
        if bias is None:
            raise CheckpointError(f"model.layers.{layer}.mlp.experts.{proj}_bias is missing; the checkpoint is "
                                  f"incomplete")
        if proj == "gate_up_proj":  # [E, dim, 2 ffn], gate in the even columns, up in the odd ones
            ours[f"{prefix}.w1"] = weight[..., 0::2].transpose(1, 2)
            ours[f"{prefix}.w3"] = weight[..., 1::2].transpose(1, 2)
            ours[f"{prefix}.b1"], ours[f"{prefix}.b3"] = bias[..., 0::2], bias[..., 1::2]
        else:  # [E, ffn, dim]
            ours[f"{prefix}.w2"], ours[f"{prefix}.b2"] = weight.transpose(1, 2), bias
    return {**hf.from_hf(dense, args, tie_word_embeddings=tie_word_embeddings), **ours}


def _expert_weight(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The unquantised expert weight `name`, from itself or its MXFP4 blocks and scales."""
    if "" in parts:
        return parts[""]
    if "_blocks" in parts and "_scales" in parts:
        return dequantize_mxfp4(parts["_blocks"], parts["_scales"])
    raise CheckpointError(f"{name} is missing (neither it nor its MXFP4 _blocks and _scales are in the checkpoint)")


def args_from_hf_config(config: dict[str, Any]) -> GptOssArgs:
    """gpt-oss's args from a Hugging Face GptOssForCausalLM config.json (transformers 4 `rope_scaling` or 5
    `rope_parameters`); a quantisation other than MXFP4 is refused."""
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if quant is not None and quant not in QUANT_METHODS:
        raise CheckpointError(f"config.json quantization_config.quant_method='{quant}' is not readable here (only "
                              f"mxfp4 experts, dequantised on import); dequantise the checkpoint first")
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise CheckpointError(f"config.json rope type '{rope_type}' is not supported for gpt_oss (default or yarn)")
    dense_config = {**config, "rope_scaling": None, "rope_parameters": None,
                    "rope_theta": config.get("rope_theta") or rope.get("rope_theta") or 150000.0}
    dense = hf.args_from_hf_config(dense_config, model_type="gpt_oss", family="gpt_oss", qkv_bias=True)
    missing = [k for k in ("num_local_experts", "num_experts_per_tok") if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is it a Hugging Face gpt_oss config?")
    n_layers = dense.n_layers
    layer_types = list(config.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)])
    own: dict[str, Any] = dict(n_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                               moe_ffn_dim=config["intermediate_size"],
                               router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
                               sliding_window=int(config.get("sliding_window") or 128), layer_types=layer_types,
                               swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                               swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), yarn_factor=None)
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
            raise CheckpointError("config.json's yarn rope sets attention_factor / mscale; gpt_oss here takes "
                                  "YaRN's default magnitude factor only")
        own.update(yarn_factor=float(rope["factor"]),
                   yarn_original_seq_len=int(rope["original_max_position_embeddings"]),
                   yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                   yarn_truncate=bool(rope.get("truncate", True)))
    fields = {name: getattr(dense, name) for name in dense.__dataclass_fields__}
    args = GptOssArgs(**fields, **own)
    args.flavor = _matching_flavor(args)
    return args


def _matching_flavor(args: GptOssArgs) -> str:
    """The flavor with these dense shapes, gpt-oss fields and alternating layers, or 'custom'."""
    dense = {name: {k: v for k, v in preset.items() if k not in OWN_FIELDS} for name, preset in FLAVORS.items()}
    flavor = matching_flavor(args, dense)
    if flavor == "custom":
        return flavor
    defaults = {f.name: f.default for f in dataclasses.fields(GptOssArgs)}
    alternating = [SLIDING if i % 2 == 0 else FULL for i in range(args.n_layers)]
    same = all(getattr(args, k) == FLAVORS[flavor].get(k, defaults[k]) for k in OWN_FIELDS if k != "layer_types")
    return flavor if same and args.layer_types == alternating else "custom"


def hf_config(args: GptOssArgs) -> dict[str, Any]:
    """config.json of a Hugging Face GptOssForCausalLM with these shapes (unquantised experts)."""
    if args.capacity_factor is not None:
        raise CheckpointError(f"a Hugging Face gpt-oss has no capacity factor (this model has capacity_factor="
                              f"{args.capacity_factor}); export it with --format pt")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn_factor is not None:
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.yarn_factor,
                "beta_fast": args.yarn_beta_fast, "beta_slow": args.yarn_beta_slow,
                "truncate": args.yarn_truncate, "original_max_position_embeddings": args.yarn_original_seq_len}
    config = hf.hf_config(args, "gpt_oss", "GptOssForCausalLM")
    config.pop("rope_scaling")
    return {**config, "intermediate_size": args.moe_ffn_dim, "attention_bias": True, "rope_parameters": rope,
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "sliding_window": args.sliding_window, "layer_types": list(args.layer_types),
            "swiglu_limit": args.swiglu_limit, "swiglu_alpha": args.swiglu_alpha,
            "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False}

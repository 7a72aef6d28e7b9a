"""DeepSeek-V3 weights and config between ours and Hugging Face's (DeepseekV3ForCausalLM; Kimi K2's checkpoints, whose
config.json says model_type "kimi_k2" on that architecture, read the same way).

Names map one to one (no row permutation: both keep DeepSeek's interleaved RoPE pairs), except the routed experts,
stacked here for the grouped GEMM and one tensor per expert in Hugging Face files:
  layers.N.attention.{wq, wq_a, q_norm, wq_b}    <-> model.layers.N.self_attn.{q_proj, q_a_proj, q_a_layernorm,
                                                     q_b_proj}
  layers.N.attention.{wkv_a, kv_norm, wkv_b, wo} <-> model.layers.N.self_attn.{kv_a_proj_with_mqa, kv_a_layernorm,
                                                     kv_b_proj, o_proj}
  layers.N.feed_forward.router.gate.weight       <-> model.layers.N.mlp.gate.weight
  layers.N.feed_forward.router.score_bias        <-> model.layers.N.mlp.gate.e_score_correction_bias
  layers.N.feed_forward.experts.w1 [E, ffn, dim] <-> model.layers.N.mlp.experts.e.gate_proj.weight, e < E (w3: up,
                                                     w2: down_proj)
  layers.N.feed_forward.shared_experts.w1/w2/w3  <-> model.layers.N.mlp.shared_experts.gate/down/up_proj
A transformers 5 in-memory state dict (experts fused: mlp.experts.gate_up_proj [E, 2 ffn, dim], gate first) is
read as well. The multi-token-prediction layers (model.layers.{num_hidden_layers + k}.*) load as our layers of the
same index when mtp_depth > k and are set aside with a one-line note otherwise; held_model cuts mtp_depth to the
layers a checkpoint holds whole (transformers' save_pretrained writes none though its config asks for one). Its fp8
weights (quantization_config fp8, 128 x 128 blocks, a `weight_scale_inv` per weight) are dequantised to fp32 on
import.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder import hf as decoder_hf
from titan_npu.models.decoder.args import matching_flavor
from titan_npu.models.deepseek_v3.args import DEEPSEEK_OVERRIDABLE, FLAVORS, YARN_FIELDS, DeepSeekArgs
from titan_npu.models.deepseek_v3.model import MTPBlock
from titan_npu.models.moe.hf_experts import MOE_UNKNOWN_NAME, ExpertStacker, stacked_expert_names

StateDict = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)

TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.score_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    # A multi-token prediction layer's own (layers.{n_layers + k}); its embed_tokens and shared_head.head are the
    # model's embedding and output head, copied into the layer on export and not read back.
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
}
MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
PER_LAYER_FROM_HF = {hf: ours for ours, hf in PER_LAYER.items()}
TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in TOP_LEVEL.items()}
FP8_BLOCK = 128  # the published fp8 checkpoint's quantization block (weight_block_size [128, 128])

_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(key: str) -> str:
    """Our parameter (or score bias) name -> its Hugging Face name; a CheckpointError for stacked experts (see
    stacked_names) and unknown names."""
    return decoder_hf.mapped_hf_name(key, TOP_LEVEL, PER_LAYER, MOE_UNKNOWN_NAME)


def stacked_names(key: str, args: DeepSeekArgs) -> list[str] | None:
    """The Hugging Face names of a stacked expert tensor's experts in order; None for any other tensor."""
    return stacked_expert_names(key, args.n_experts)


def to_hf(state_dict: StateDict, args: DeepSeekArgs) -> StateDict:
    """Our state dict -> Hugging Face's names: stacked experts cut into one tensor per expert."""
    out = {}
    for key, tensor in state_dict.items():
        names = stacked_names(key, args)
        if names is not None:
            out.update(zip(names, tensor.unbind(0)))
        elif not (key == "output.weight" and args.tie_embeddings):
            out[hf_name(key)] = tensor
    for layer in range(args.n_layers, args.n_layers + args.mtp_depth):
        out.update({f"model.layers.{layer}.{hf}": state_dict[ours] for hf, ours in MTP_SHARED.items()
                    if ours in state_dict})
    return out


def from_hf_layout(key: str, tensor: torch.Tensor, args: DeepSeekArgs) -> torch.Tensor:
    """A Hugging Face tensor (or a slice of it) under our name: the same layout; fp8 is refused (its block scales
    are read whole by `titan-npu import`, not slice by slice)."""
    if tensor.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"{key} is fp8 with block scales; dequantise the checkpoint first with "
                              f"`titan-npu import` and load the result")
    return tensor


def dequantise_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, key: str) -> torch.Tensor:
    """An fp8 weight [out, in] times its per-block scales [ceil(out/128), ceil(in/128)] -> fp32."""
    expected = tuple(-(-n // FP8_BLOCK) for n in weight.shape)
    if weight.dim() != 2 or tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{key}: weight {tuple(weight.shape)} with scales {tuple(scale_inv.shape)} is not "
                              f"{FP8_BLOCK} x {FP8_BLOCK} block quantisation (scales {expected} expected)")
    scales = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.float() * scales[:weight.shape[0], :weight.shape[1]]


def from_hf(hf_state_dict: StateDict, args: DeepSeekArgs, *, tie_word_embeddings: bool = False) -> StateDict:
    """A Hugging Face state dict (per-expert or fused experts, bf16/fp32 or fp8 with block scales) -> ours, experts
    stacked; the multi-token-prediction layers past n_layers are set aside."""
    scales = {k[:-len("_scale_inv")]: v for k, v in hf_state_dict.items() if k.endswith(".weight_scale_inv")}
    if scales:
        logger.info("fp8 checkpoint: %d weights dequantised to fp32 from their 128x128 block scales", len(scales))
    ours: StateDict = {}
    experts = ExpertStacker()
    set_aside: set[int] = set()
    for key, tensor in hf_state_dict.items():
        if key.endswith(".weight_scale_inv"):
            continue
        if key in scales:
            tensor = dequantise_fp8(tensor, scales[key], key)
        if key in TOP_LEVEL_FROM_HF:
            ours[TOP_LEVEL_FROM_HF[key]] = tensor
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise CheckpointError(f"Hugging Face key '{key}' has no counterpart in a DeepSeek-V3 model")
        layer, rest = match.group(1), match.group(2)
        if int(layer) >= args.n_layers + args.mtp_depth:
            set_aside.add(int(layer))
            continue
        if int(layer) >= args.n_layers and rest in MTP_SHARED:
            continue  # the model's own embedding / output head
        if experts.take(layer, rest, tensor, ours):
            continue
        if rest in PER_LAYER_FROM_HF:
            ours[f"layers.{layer}.{PER_LAYER_FROM_HF[rest]}"] = tensor
        else:
            raise CheckpointError(f"Hugging Face key '{key}' has no counterpart in a DeepSeek-V3 model")
    if set_aside:
        logger.info("layers %s of the checkpoint (multi-token prediction) set aside: model.mtp_depth=%d",
                    sorted(set_aside), args.mtp_depth)
    experts.stack_into(ours, args.n_experts)
    if tie_word_embeddings and "tok_embeddings.weight" in ours:
        embedding = ours["tok_embeddings.weight"]
        ours["output.weight"] = embedding if args.tie_embeddings else embedding.clone()
    return ours


def held_model(state_dict: StateDict, args: DeepSeekArgs) -> tuple[StateDict, DeepSeekArgs, str | None]:
    """The weights from_hf gave and the args of the model they fill: mtp_depth cut to the leading
    multi-token-prediction layers held whole (an absent or partial one and those after it set aside), with one line
    saying so; None for the line when the weights hold every layer config.json asks for."""
    held = 0
    while held < args.mtp_depth and all(k in state_dict for k in _mtp_layer_keys(args, args.n_layers + held)):
        held += 1
    if held == args.mtp_depth:
        return state_dict, args, None
    first = args.n_layers + held
    present = sum(1 for k in state_dict if k.startswith(f"layers.{first}."))
    what = f"partial ({present} of {len(_mtp_layer_keys(args, first))} tensors)" if present else "absent"
    layers = {k: int(match.group(1)) if (match := _OUR_LAYER.fullmatch(k)) else -1 for k in state_dict}
    set_aside = sorted({layer for layer in layers.values() if layer >= first})
    fitted = dataclasses.replace(args, mtp_depth=held)
    fitted.flavor = _matching_flavor(fitted)
    note = (f"config.json asks for {args.mtp_depth} multi-token-prediction layer(s) (num_nextn_predict_layers) but "
            f"layer {first} is {what} in the weights: model.mtp_depth = {held}"
            + (f", layer(s) {', '.join(map(str, set_aside))} set aside" if set_aside else ""))
    return {k: v for k, v in state_dict.items() if layers[k] < first}, fitted, note


def _mtp_layer_keys(args: DeepSeekArgs, layer: int) -> list[str]:
    """Our names of multi-token-prediction layer `layer`'s tensors (its embedding and head are the model's)."""
    with torch.device("meta"):
        block = MTPBlock(layer, args)
    return [f"layers.{layer}.{k}" for k in block.state_dict()]


def args_from_hf_config(config: dict[str, Any]) -> DeepSeekArgs:
    """DeepSeek-V3's args from a Hugging Face DeepseekV3ForCausalLM config.json, refusing what the model cannot be."""
    if config.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
        raise CheckpointError(f"config.json model_type='{config.get('model_type')}' is not 'deepseek_v3' (or Kimi K2's "
                              f"'kimi_k2', the same architecture)")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size", "moe_intermediate_size", "n_routed_experts", "kv_lora_rank",
                           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is it a Hugging Face deepseek_v3 config?")
    quant = config.get("quantization_config")
    if quant and (quant.get("quant_method") != "fp8" or list(quant.get("weight_block_size", [])) != [FP8_BLOCK] * 2):
        raise CheckpointError(f"config.json quantization_config {quant} is not fp8 with {FP8_BLOCK}x{FP8_BLOCK} "
                              f"blocks, the one quantisation imported (dequantised)")
    unsupported = {"hidden_act": config.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(config.get("attention_bias", False)),
                   "rope_interleave": not config.get("rope_interleave", True),
                   "scoring_func": config.get("scoring_func", "sigmoid") != "sigmoid",
                   "topk_method": config.get("topk_method", "noaux_tc") != "noaux_tc"}
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise CheckpointError(f"config.json has {bad}; deepseek_v3 here means a silu MLP, no attention biases, "
                              f"interleaved RoPE pairs and sigmoid group-limited (noaux_tc) routing")
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise CheckpointError(f"config.json rope type '{rope_type}' is not supported (default or yarn)")
    yarn = {}
    if rope_type == "yarn":
        yarn = dict(yarn_factor=float(rope["factor"]),
                    yarn_original_seq_len=int(rope["original_max_position_embeddings"]),
                    yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                    yarn_mscale=float(rope.get("mscale") or 0.0),
                    yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    n_experts = config["n_routed_experts"]
    try:
        args = DeepSeekArgs(
            dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
            vocab_size=config["vocab_size"], ffn_dim=config["intermediate_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)), family="deepseek_v3",
            q_lora_rank=config.get("q_lora_rank") or 0, kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"], n_experts=n_experts, top_k=config.get("num_experts_per_tok", 8),
            moe_ffn_dim=config["moe_intermediate_size"], n_shared_experts=config.get("n_shared_experts", 1),
            n_groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
            route_scale=float(config.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            first_k_dense=config.get("first_k_dense_replace", 0),
            mtp_depth=int(config.get("num_nextn_predict_layers", config.get("num_mtp_layers")) or 0), **yarn)
    except Exception as e:
        raise CheckpointError(f"config.json describes a model that cannot be built: {e}") from e
    args.flavor = _matching_flavor(args)
    return args


def _matching_flavor(args: DeepSeekArgs) -> str:
    """The flavor with these shapes, routing and YaRN, or 'custom'."""
    # The decoder's match compares head_dim: a DeepSeek query/key head is qk_nope + qk_rope wide.
    flavors = {name: {**preset, "head_dim": preset["qk_nope_head_dim"] + preset["qk_rope_head_dim"]}
               for name, preset in FLAVORS.items()}
    return matching_flavor(args, flavors, own=(*DEEPSEEK_OVERRIDABLE, *YARN_FIELDS))


def hf_config(args: DeepSeekArgs) -> dict[str, Any]:
    """config.json of a Hugging Face DeepseekV3ForCausalLM with these shapes."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn_factor is not None:
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.yarn_factor,
                "original_max_position_embeddings": args.yarn_original_seq_len, "beta_fast": args.yarn_beta_fast,
                "beta_slow": args.yarn_beta_slow, "mscale": args.yarn_mscale,
                "mscale_all_dim": args.yarn_mscale_all_dim}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim, "moe_intermediate_size": args.moe_ffn_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_heads, "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_parameters": rope, "rope_interleave": True, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": args.tie_embeddings, "initializer_range": 0.02,
            "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim, "n_routed_experts": args.n_experts, "num_experts_per_tok": args.top_k,
            "n_shared_experts": args.n_shared_experts, "n_group": args.n_groups, "topk_group": args.topk_groups,
            "routed_scaling_factor": args.route_scale, "norm_topk_prob": args.norm_topk_prob,
            "first_k_dense_replace": args.first_k_dense, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "num_nextn_predict_layers": args.mtp_depth}

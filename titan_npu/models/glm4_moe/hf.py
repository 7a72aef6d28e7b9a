"""GLM-4.5 weights and config between ours and Hugging Face's (Glm4MoeForCausalLM).

Names map as the dense decoder's (models/decoder/hf.py) but unpermuted (both rotate halves of each head's leading
dims), plus the MoE layers' tensors; the routed experts are stacked here for the grouped GEMM and one tensor per expert
in Hugging Face files:
  layers.N.feed_forward.router.gate.weight       <-> model.layers.N.mlp.gate.weight
  layers.N.feed_forward.router.score_bias        <-> model.layers.N.mlp.gate.e_score_correction_bias
  layers.N.feed_forward.experts.w1 [E, ffn, dim] <-> model.layers.N.mlp.experts.e.gate_proj.weight, e < E (w3: up,
                                                     w2: down_proj)
  layers.N.feed_forward.shared_experts.w1/w2/w3  <-> model.layers.N.mlp.shared_experts.gate/down/up_proj
A transformers 5 in-memory state dict (experts fused: mlp.experts.gate_up_proj [E, 2 ffn, dim], gate first) is read as
well. The published checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the last one
(model.layers.{num_hidden_layers + k}.*, which transformers' Glm4MoeForCausalLM does not load either): import sets
them aside with a one-line note, and an export declares none.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder import hf as decoder_hf
from titan_npu.models.decoder.args import matching_flavor
from titan_npu.models.glm4_moe.args import FLAVORS, GLM4_MOE_OVERRIDABLE, Glm4MoeArgs
from titan_npu.models.moe.hf_experts import MOE_UNKNOWN_NAME, ExpertStacker, stacked_expert_names

StateDict = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)

PER_LAYER = {
    **decoder_hf.PER_LAYER,
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.score_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
PER_LAYER_FROM_HF = {hf: ours for ours, hf in PER_LAYER.items()}

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(key: str) -> str:
    """Our parameter (or score bias) name -> its Hugging Face name; a CheckpointError for stacked experts (see
    stacked_names) and unknown names."""
    return decoder_hf.mapped_hf_name(key, decoder_hf.TOP_LEVEL, PER_LAYER, MOE_UNKNOWN_NAME)


def stacked_names(key: str, args: Glm4MoeArgs) -> list[str] | None:
    """The Hugging Face names of a stacked expert tensor's experts in order; None for any other tensor."""
    return stacked_expert_names(key, args.n_experts)


def from_hf_layout(key: str, tensor: torch.Tensor, args: Glm4MoeArgs) -> torch.Tensor:
    """A Hugging Face tensor (or a slice of it) under our name: the same layout."""
    return tensor


def to_hf(state_dict: StateDict, args: Glm4MoeArgs) -> StateDict:
    """Our state dict -> Hugging Face's names: stacked experts cut into one tensor per expert."""
    out = {}
    for key, tensor in state_dict.items():
        names = stacked_names(key, args)
        if names is not None:
            out.update(zip(names, tensor.unbind(0)))
        elif not (key == "output.weight" and args.tie_embeddings):
            out[hf_name(key)] = tensor
    return out


def from_hf(hf_state_dict: StateDict, args: Glm4MoeArgs, *, tie_word_embeddings: bool = False) -> StateDict:
    """A Hugging Face state dict (per-expert or fused experts) -> ours, experts stacked; the multi-token-prediction
    layers past n_layers are set aside."""
    ours: StateDict = {}
    experts = ExpertStacker()
    set_aside: set[int] = set()
    for key, tensor in hf_state_dict.items():
        if key in decoder_hf.TOP_LEVEL_FROM_HF:
            ours[decoder_hf.TOP_LEVEL_FROM_HF[key]] = tensor
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise CheckpointError(f"Hugging Face key '{key}' has no counterpart in a GLM-4.5 model")
        layer, rest = match.group(1), match.group(2)
        if int(layer) >= args.n_layers:
            set_aside.add(int(layer))
        elif rest == decoder_hf.HF_IGNORED_SUFFIX:
            continue
        elif experts.take(layer, rest, tensor, ours):
            continue
        elif rest in PER_LAYER_FROM_HF:
            ours[f"layers.{layer}.{PER_LAYER_FROM_HF[rest]}"] = tensor
        else:
            raise CheckpointError(f"Hugging Face key '{key}' has no counterpart in a GLM-4.5 model")
    if set_aside:
        logger.info("layers %s of the checkpoint (multi-token prediction) set aside: a GLM-4.5 here trains its %d "
                    "decoder layers", sorted(set_aside), args.n_layers)
    experts.stack_into(ours, args.n_experts)
    if tie_word_embeddings and "tok_embeddings.weight" in ours:
        embedding = ours["tok_embeddings.weight"]
        ours["output.weight"] = embedding if args.tie_embeddings else embedding.clone()
    return ours


def args_from_hf_config(config: dict[str, Any]) -> Glm4MoeArgs:
    """GLM-4.5's args from a Hugging Face Glm4MoeForCausalLM config.json, refusing what the model cannot be."""
    dense = decoder_hf.args_from_hf_config(config, model_type="glm4_moe", family="glm4_moe",
                                           qkv_bias=bool(config.get("attention_bias", False)),
                                           qk_norm=bool(config.get("use_qk_norm", False)))
    missing = [k for k in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok") if k not in config]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is it a Hugging Face glm4_moe config?")
    unsupported = {"scoring_func": config.get("scoring_func", "sigmoid") != "sigmoid",
                   "topk_method": config.get("topk_method", "noaux_tc") != "noaux_tc"}
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise CheckpointError(f"config.json has {bad}; glm4_moe here means sigmoid group-limited (noaux_tc) routing "
                              f"with the score-correction bias")
    if dense.rope_scaling_factor is not None:
        raise CheckpointError("config.json has llama3 rope scaling; a glm4_moe model here takes plain RoPE only "
                              "(remove rope_scaling to train at the model's native context)")
    rope = dict(config.get("rope_parameters") or {})
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
    fields = {name: getattr(dense, name) for name in dense.__dataclass_fields__}
    try:
        args = Glm4MoeArgs(
            **fields, n_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
            moe_ffn_dim=config["moe_intermediate_size"], norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            partial_rotary_factor=float(partial), n_shared_experts=int(config.get("n_shared_experts") or 0),
            n_groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
            route_scale=float(config.get("routed_scaling_factor", 1.0)),
            first_k_dense=int(config.get("first_k_dense_replace", 1)))
    except Exception as e:
        raise CheckpointError(f"config.json describes a model that cannot be built: {e}") from e
    args.flavor = matching_flavor(args, FLAVORS, own=GLM4_MOE_OVERRIDABLE)
    return args


def hf_config(args: Glm4MoeArgs) -> dict[str, Any]:
    """config.json of a Hugging Face Glm4MoeForCausalLM with these shapes (no multi-token-prediction layer)."""
    config = decoder_hf.hf_config(args, "glm4_moe", "Glm4MoeForCausalLM")
    del config["rope_scaling"]
    return {**config, "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                                          "partial_rotary_factor": args.partial_rotary_factor},
            "partial_rotary_factor": args.partial_rotary_factor, "use_qk_norm": args.qk_norm,
            "moe_intermediate_size": args.moe_ffn_dim, "n_routed_experts": args.n_experts,
            "num_experts_per_tok": args.top_k, "n_shared_experts": args.n_shared_experts, "n_group": args.n_groups,
            "topk_group": args.topk_groups, "routed_scaling_factor": args.route_scale,
            "norm_topk_prob": args.norm_topk_prob, "first_k_dense_replace": args.first_k_dense,
            "num_nextn_predict_layers": 0}

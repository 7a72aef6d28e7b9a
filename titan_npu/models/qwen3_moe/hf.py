"""Qwen3-MoE weights and config between ours and Hugging Face's (Qwen3MoeForCausalLM).

Everything but the MoE feed-forwards maps as dense Qwen3's (models/decoder/hf.py, q/k rows permuted into HF's RoPE
layout). Our experts are stacked for the grouped GEMM; Hugging Face files hold one tensor per expert:
  layers.N.feed_forward.router.gate.weight [E, dim]    <-> model.layers.N.mlp.gate.weight
  layers.N.feed_forward.experts.w1 [E, ffn, dim]       <-> model.layers.N.mlp.experts.e.gate_proj.weight, e < E
  layers.N.feed_forward.experts.w3 [E, ffn, dim]       <-> model.layers.N.mlp.experts.e.up_proj.weight
  layers.N.feed_forward.experts.w2 [E, dim, ffn]       <-> model.layers.N.mlp.experts.e.down_proj.weight
A transformers 5 in-memory state dict (experts fused: mlp.experts.gate_up_proj [E, 2 ffn, dim] with gate first,
mlp.experts.down_proj [E, dim, ffn]) is read as well.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder import hf
from titan_npu.models.decoder.args import matching_flavor
from titan_npu.models.moe_decoder.args import MOE_OVERRIDABLE, MoEDecoderArgs
from titan_npu.models.qwen3_moe.args import FLAVORS

StateDict = dict[str, torch.Tensor]

EXPERT_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OUR_MOE = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.gate\.weight|experts\.(w[123]))")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_HF_GATE = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


def hf_name(key: str) -> str:
    """Our parameter name -> its Hugging Face name (a CheckpointError for stacked experts: see stacked_names)."""
    match = _OUR_MOE.fullmatch(key)
    if match is None:
        return hf.hf_name(key)
    if match.group(3) is None:
        return f"model.layers.{match.group(1)}.mlp.gate.weight"
    raise CheckpointError(f"'{key}' stacks every expert of layer {match.group(1)}; Hugging Face holds one tensor per "
                          f"expert (stacked_names gives their names)")


def stacked_names(key: str, args: MoEDecoderArgs) -> list[str] | None:
    """The Hugging Face names of a stacked expert tensor's experts in order; None for any other tensor."""
    match = _OUR_MOE.fullmatch(key)
    if match is None or match.group(3) is None:
        return None
    proj = EXPERT_PROJECTIONS[match.group(3)]
    return [f"model.layers.{match.group(1)}.mlp.experts.{e}.{proj}.weight" for e in range(args.n_experts)]


def to_hf(state_dict: StateDict, args: MoEDecoderArgs) -> StateDict:
    """Our state dict -> Hugging Face's names: stacked experts cut into one tensor per expert."""
    dense, out = {}, {}
    for key, tensor in state_dict.items():
        match = _OUR_MOE.fullmatch(key)
        if match is None:
            dense[key] = tensor
        elif match.group(3) is None:
            out[hf_name(key)] = tensor
        else:
            out.update(zip(stacked_names(key, args), tensor.unbind(0)))
    return {**hf.to_hf(dense, args), **out}


def from_hf(hf_state_dict: StateDict, args: MoEDecoderArgs, *, tie_word_embeddings: bool = False) -> StateDict:
    """A Hugging Face state dict (per-expert or transformers' fused experts) -> ours, experts stacked."""
    dense, ours = {}, {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in hf_state_dict.items():
        if (match := _HF_EXPERT.fullmatch(key)) is not None:
            ours_name = {v: k for k, v in EXPERT_PROJECTIONS.items()}[match.group(3)]
            experts.setdefault((match.group(1), ours_name), {})[int(match.group(2))] = tensor
        elif (match := _HF_FUSED.fullmatch(key)) is not None:
            prefix = f"layers.{match.group(1)}.feed_forward.experts"
            if match.group(2) == "down_proj":
                ours[f"{prefix}.w2"] = tensor
            else:
                ours[f"{prefix}.w1"], ours[f"{prefix}.w3"] = tensor.chunk(2, dim=1)
        elif (match := _HF_GATE.fullmatch(key)) is not None:
            ours[f"layers.{match.group(1)}.feed_forward.router.gate.weight"] = tensor
        else:
            dense[key] = tensor
    for (layer, name), per_expert in experts.items():
        if sorted(per_expert) != list(range(args.n_experts)):
            raise CheckpointError(f"layer {layer} holds experts {sorted(per_expert)} of its {name} projection but the "
                                  f"config says num_experts={args.n_experts}; the checkpoint is incomplete")
        ours[f"layers.{layer}.feed_forward.experts.{name}"] = torch.stack([per_expert[e]
                                                                            for e in range(args.n_experts)])
    return {**hf.from_hf(dense, args, tie_word_embeddings=tie_word_embeddings), **ours}


def args_from_hf_config(config: dict[str, Any]) -> MoEDecoderArgs:
    """Qwen3-MoE's args from a Hugging Face Qwen3MoeForCausalLM config.json."""
    dense = hf.args_from_hf_config(config, model_type="qwen3_moe", family="qwen3_moe", qk_norm=True)
    n_experts = config.get("num_experts", config.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", n_experts), ("num_experts_per_tok", config.get("num_experts_per_tok")),
                              ("moe_intermediate_size", config.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; is it a Hugging Face qwen3_moe config?")
    moe = dict(n_experts=n_experts, top_k=config["num_experts_per_tok"], moe_ffn_dim=config["moe_intermediate_size"],
               norm_topk_prob=bool(config.get("norm_topk_prob", False)),
               decoder_sparse_step=config.get("decoder_sparse_step", 1),
               mlp_only_layers=list(config.get("mlp_only_layers") or []),
               router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))
    fields = {name: getattr(dense, name) for name in dense.__dataclass_fields__}
    args = MoEDecoderArgs(**fields, **moe)
    args.flavor = matching_flavor(args, FLAVORS, own=MOE_OVERRIDABLE)
    return args


def hf_config(args: MoEDecoderArgs) -> dict[str, Any]:
    """config.json of a Hugging Face Qwen3MoeForCausalLM with these shapes."""
    if args.capacity_factor is not None or args.shared_ffn_dim:
        raise CheckpointError(f"a Hugging Face Qwen3-MoE has neither a capacity factor nor shared experts (this model "
                              f"has capacity_factor={args.capacity_factor}, shared_ffn_dim={args.shared_ffn_dim}); "
                              f"export it with --format pt")
    return {**hf.hf_config(args, "qwen3_moe", "Qwen3MoeForCausalLM"), "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": args.n_layers, "num_experts": args.n_experts,
            "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_ffn_dim,
            "norm_topk_prob": args.norm_topk_prob, "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers), "router_aux_loss_coef": args.router_aux_loss_coef,
            "output_router_logits": False}

"""Qwen3-Next / Qwen3.5 weights and config between ours and Hugging Face's (Qwen3NextForCausalLM, Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM; the Qwen3.5 checkpoints' language model too, under model.language_model., vision tower and MTP
layers left out).

Ours after "layers.N." <-> Hugging Face's after "model.layers.N.", no row permutation (RoPE rotates halves in both):
  attention_norm / ffn_norm                      <-> input_layernorm / post_attention_layernorm (zero-centred both)
  attention.wq/wk/wv/wo, q_norm, k_norm          <-> self_attn.q_proj/k_proj/v_proj/o_proj, q_norm, k_norm
  attention.in_q/in_k/in_v (linear layer)        <-> linear_attn.in_proj_qkv rows [q | k | v] (Qwen3.5), or
      linear_attn.in_proj_qkvz (Qwen3-Next): per key head [q (dk) | k (dk) | its value heads' v | their z]
  attention.in_z                                 <-> linear_attn.in_proj_z (Qwen3.5), z of in_proj_qkvz (Qwen3-Next)
  attention.in_b / in_a                          <-> linear_attn.in_proj_b / in_proj_a (Qwen3.5), or in_proj_ba:
      per key head [its value heads' b | their a] (Qwen3-Next)
  attention.conv_q/conv_k/conv_v [C, K]          <-> linear_attn.conv1d.weight [2 Kd + Vd, 1, K] rows [q | k | v]
  attention.A_log, dt_bias, norm_weight, out     <-> linear_attn.A_log, dt_bias, norm.weight, out_proj
  feed_forward.w1/w2/w3 (dense layer)            <-> mlp.gate_proj/down_proj/up_proj
  feed_forward.router.gate.weight                <-> mlp.gate.weight
  feed_forward.experts.w1/w3/w2 [E, ...]         <-> mlp.experts.e.gate_proj/up_proj/down_proj (or transformers'
      in-memory fused mlp.experts.gate_up_proj [E, 2 ffn, dim] gate first, down_proj [E, dim, ffn])
  feed_forward.shared_experts.w1/w2/w3, shared_gate <-> mlp.shared_expert.gate_proj/down_proj/up_proj,
      mlp.shared_expert_gate
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder import hf as decoder_hf
from titan_npu.models.decoder.args import DecoderArgs, matching_flavor
from titan_npu.models.qwen3_next.args import FLAVORS, FULL, LINEAR, OWN_FIELDS, Qwen3NextArgs

StateDict = dict[str, torch.Tensor]

MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
# The linear layer's tensors HF holds as they are (the mixer is `attention` in ours, `linear_attn` in HF's).
LINEAR_PER_LAYER = {"attention.A_log": "linear_attn.A_log", "attention.dt_bias": "linear_attn.dt_bias",
                    "attention.norm_weight": "linear_attn.norm.weight",
                    "attention.out.weight": "linear_attn.out_proj.weight",
                    "attention.in_z.weight": "linear_attn.in_proj_z.weight",
                    "attention.in_b.weight": "linear_attn.in_proj_b.weight",
                    "attention.in_a.weight": "linear_attn.in_proj_a.weight"}
EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# Parts of a Qwen3.5 checkpoint that are not the language model.
_HF_SKIPPED = re.compile(r"(model\.visual\.|mtp\.|model\.mtp\.).*|.*rotary_emb\.inv_freq")


def hf_name(key: str) -> str:
    """Our parameter name -> its Hugging Face name, for the tensors HF holds whole (a CheckpointError for a slice of
    a fused HF tensor or a stacked expert tensor)."""
    if key in TOP_LEVEL:
        return TOP_LEVEL[key]
    match = _OUR_LAYER.fullmatch(key)
    if match is not None and match.group(2) in PER_LAYER:
        return f"model.layers.{match.group(1)}.{PER_LAYER[match.group(2)]}"
    raise CheckpointError(f"'{key}' is not held whole by a Hugging Face Qwen3-Next / Qwen3.5 checkpoint (a linear "
                          f"layer's projections and convolution, and the experts, are fused or per expert there)")


def _layer_kinds(args: Qwen3NextArgs) -> list[bool]:
    return [args.is_linear_layer(i) for i in range(args.n_layers)]


def to_hf(state_dict: StateDict, args: Qwen3NextArgs) -> StateDict:
    """Our state dict -> Hugging Face's names and layouts (args.variant's: Qwen3-Next's fused in_proj_qkvz / ba or
    Qwen3.5's separate projections; experts one tensor each)."""
    out: StateDict = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        if key in TOP_LEVEL:
            if not (key == "output.weight" and args.tie_embeddings):
                out[TOP_LEVEL[key]] = tensor
            continue
        match = _OUR_LAYER.fullmatch(key)
        if match is None:
            raise CheckpointError(f"state dict key '{key}' is not a parameter of this model; export only its weights")
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    linear = _layer_kinds(args)
    for layer, tensors in layers.items():
        prefix = f"model.layers.{layer}"
        if linear[layer]:
            out.update({f"{prefix}.{k}": v for k, v in _linear_to_hf(tensors, args).items()})
        for name, tensor in tensors.items():
            if name.startswith("feed_forward.experts."):
                which = name.rsplit(".", 1)[1]
                out.update({f"{prefix}.mlp.experts.{e}.{EXPERTS[which]}.weight": t
                            for e, t in enumerate(tensor.unbind(0))})
            elif name in PER_LAYER and not (linear[layer] and name.startswith("attention.")):
                out[f"{prefix}.{PER_LAYER[name]}"] = tensor
    return out


def _linear_to_hf(t: dict[str, torch.Tensor], args: Qwen3NextArgs) -> StateDict:
    """One linear layer's tensors in Hugging Face's layout (names after "model.layers.N.")."""
    out = {hf: t[ours] for ours, hf in LINEAR_PER_LAYER.items() if ours in t}
    out["linear_attn.conv1d.weight"] = torch.cat((t["attention.conv_q"], t["attention.conv_k"],
                                                  t["attention.conv_v"])).unsqueeze(1)
    q, k, v, z = (t[f"attention.in_{x}.weight"] for x in "qkvz")
    if args.variant == "qwen3_5":
        out["linear_attn.in_proj_qkv.weight"] = torch.cat((q, k, v))
        return out
    heads = args.linear_n_k_heads
    for name in ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        out.pop(name)
    dim = q.shape[1]
    out["linear_attn.in_proj_qkvz.weight"] = torch.cat(
        [x.reshape(heads, -1, dim) for x in (q, k, v, z)], dim=1).reshape(-1, dim)
    out["linear_attn.in_proj_ba.weight"] = torch.cat(
        [t[f"attention.in_{x}.weight"].reshape(heads, -1, dim) for x in "ba"], dim=1).reshape(-1, dim)
    return out


def from_hf(hf_state_dict: StateDict, args: Qwen3NextArgs, *, tie_word_embeddings: bool = False) -> StateDict:
    """A Hugging Face state dict (either layout, per-expert or fused experts, a Qwen3.5 checkpoint's language model)
    -> ours."""
    ours: StateDict = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    from_top = {v: k for k, v in TOP_LEVEL.items()}
    for key, tensor in hf_state_dict.items():
        key = key.replace("model.language_model.", "model.", 1)
        if _HF_SKIPPED.fullmatch(key):
            continue
        if key in from_top:
            ours[from_top[key]] = tensor
            continue
        match = _HF_LAYER.fullmatch(key)
        if match is None:
            raise CheckpointError(f"Hugging Face key '{key}' has no counterpart in this model; is the checkpoint of "
                                  f"the model_type its config.json names?")
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    from_layer = {v: k for k, v in PER_LAYER.items()}
    for layer, tensors in layers.items():
        prefix = f"layers.{layer}"
        experts: dict[str, dict[int, torch.Tensor]] = {}
        linear = {k: v for k, v in tensors.items() if k.startswith("linear_attn.")}
        if linear:
            ours.update({f"{prefix}.{k}": v for k, v in _linear_from_hf(linear, args, layer).items()})
        for name, tensor in tensors.items():
            if name in linear:
                continue
            if (match := _HF_EXPERT.fullmatch(name)) is not None:
                which = {v: k for k, v in EXPERTS.items()}[match.group(2)]
                experts.setdefault(which, {})[int(match.group(1))] = tensor
            elif name == "mlp.experts.gate_up_proj":
                ours[f"{prefix}.feed_forward.experts.w1"], ours[f"{prefix}.feed_forward.experts.w3"] = \
                    tensor.chunk(2, dim=1)
            elif name == "mlp.experts.down_proj":
                ours[f"{prefix}.feed_forward.experts.w2"] = tensor
            elif name in from_layer:
                ours[f"{prefix}.{from_layer[name]}"] = tensor
            else:
                raise CheckpointError(f"Hugging Face key 'model.layers.{layer}.{name}' has no counterpart in this "
                                      f"model; is the checkpoint of the model_type its config.json names?")
        for which, per_expert in experts.items():
            if sorted(per_expert) != list(range(args.n_experts)):
                raise CheckpointError(f"layer {layer} holds experts {sorted(per_expert)} of its {EXPERTS[which]} but "
                                      f"the config says num_experts={args.n_experts}; the checkpoint is incomplete")
            ours[f"{prefix}.feed_forward.experts.{which}"] = torch.stack([per_expert[e]
                                                                          for e in range(args.n_experts)])
    if tie_word_embeddings and "tok_embeddings.weight" in ours:
        embedding = ours["tok_embeddings.weight"]
        ours["output.weight"] = embedding if args.tie_embeddings else embedding.clone()
    return ours


def _linear_from_hf(t: dict[str, torch.Tensor], args: Qwen3NextArgs, layer: int) -> StateDict:
    """One linear layer's Hugging Face tensors (names after "model.layers.N.") -> ours (after "layers.N.")."""
    kd, vd = args.linear_key_dim, args.linear_value_dim
    out = {ours: t[hf] for ours, hf in LINEAR_PER_LAYER.items() if hf in t}
    conv = t["linear_attn.conv1d.weight"].squeeze(1)
    out["attention.conv_q"], out["attention.conv_k"], out["attention.conv_v"] = conv.split((kd, kd, vd))
    if "linear_attn.in_proj_qkv.weight" in t:
        q, k, v = t["linear_attn.in_proj_qkv.weight"].split((kd, kd, vd))
        out.update({"attention.in_q.weight": q, "attention.in_k.weight": k, "attention.in_v.weight": v})
        return out
    if "linear_attn.in_proj_qkvz.weight" not in t or "linear_attn.in_proj_ba.weight" not in t:
        raise CheckpointError(f"linear layer {layer} has neither in_proj_qkv nor in_proj_qkvz / in_proj_ba; the "
                              f"checkpoint is incomplete")
    heads, dk, per_head = args.linear_n_k_heads, args.linear_k_head_dim, vd // args.linear_n_k_heads
    qkvz = t["linear_attn.in_proj_qkvz.weight"]
    dim = qkvz.shape[1]
    q, k, v, z = qkvz.reshape(heads, -1, dim).split((dk, dk, per_head, per_head), dim=1)
    b, a = t["linear_attn.in_proj_ba.weight"].reshape(heads, -1, dim).chunk(2, dim=1)
    for name, x in zip("qkvzba", (q, k, v, z, b, a)):
        out[f"attention.in_{name}.weight"] = x.reshape(-1, dim)
    return out


def args_from_hf_config(config: dict[str, Any]) -> Qwen3NextArgs:
    """Our args from a Hugging Face config.json of Qwen3-Next or Qwen3.5 (dense or MoE; a multimodal checkpoint's
    text_config)."""
    model_type = config.get("model_type")
    if "text_config" in config:
        config = {**config["text_config"], "tie_word_embeddings": config.get(
            "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}
        config["model_type"] = model_type + "_text" if not model_type.endswith("_text") else model_type
        model_type = config["model_type"]
    variant = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5"
    rope = {**config, **dict(config.get("rope_parameters") or config.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json rope type '{rope_type}' is not supported for {model_type} (default only)")
    n_experts = int(config.get("num_experts") or 0)
    if model_type.startswith("qwen3_5") and "moe" not in model_type:
        n_experts = 0
    moe_ffn = config.get("moe_intermediate_size") or 0
    dense_config = {**config, "model_type": model_type, "rope_scaling": None, "rope_parameters": None,
                    "rope_theta": rope.get("rope_theta") or 10000.0,
                    "intermediate_size": config.get("intermediate_size") or moe_ffn}
    dense = decoder_hf.args_from_hf_config(dense_config, model_type=model_type, family="qwen3_next", qk_norm=True)
    own: dict[str, Any] = dict(
        layer_types=list(config.get("layer_types") or []),
        full_attention_interval=int(config.get("full_attention_interval") or 4),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
        linear_n_k_heads=config.get("linear_num_key_heads", 16),
        linear_n_v_heads=config.get("linear_num_value_heads", 32),
        linear_k_head_dim=config.get("linear_key_head_dim", 128),
        linear_v_head_dim=config.get("linear_value_head_dim", 128),
        linear_conv_kernel=config.get("linear_conv_kernel_dim", 4), variant=variant)
    if n_experts:
        own.update(n_experts=n_experts, top_k=config["num_experts_per_tok"], moe_ffn_dim=moe_ffn,
                   shared_ffn_dim=config.get("shared_expert_intermediate_size") or 0,
                   norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                   decoder_sparse_step=config.get("decoder_sparse_step", 1),
                   mlp_only_layers=list(config.get("mlp_only_layers") or []),
                   router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))
    else:
        own["n_experts"] = 0
    args = Qwen3NextArgs(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(DecoderArgs)}, **own)
    args.flavor = _matching_flavor(args)
    return args


def _matching_flavor(args: Qwen3NextArgs) -> str:
    """The flavor with these shapes and hybrid fields, or 'custom'."""
    dense = {name: {k: v for k, v in preset.items() if k not in OWN_FIELDS} for name, preset in FLAVORS.items()}
    flavor = matching_flavor(args, dense)
    if flavor == "custom":
        return flavor
    defaults = {f.name: f.default for f in dataclasses.fields(Qwen3NextArgs)}
    preset = FLAVORS[flavor]
    same = all(getattr(args, k) == preset.get(k, defaults[k]) for k in OWN_FIELDS
               if k not in ("layer_types", "capacity_factor", "mlp_only_layers") and k in preset)
    interval = [FULL if (i + 1) % args.full_attention_interval == 0 else LINEAR for i in range(args.n_layers)]
    return flavor if same and args.layer_types == interval else "custom"


def hf_config(args: Qwen3NextArgs) -> dict[str, Any]:
    """config.json of the Hugging Face causal LM of args.variant (Qwen3NextForCausalLM, Qwen3_5ForCausalLM or
    Qwen3_5MoeForCausalLM) with these shapes."""
    if args.n_experts and (args.capacity_factor is not None or not args.shared_ffn_dim):
        raise CheckpointError(f"a Hugging Face {args.variant} MoE has a shared expert and no capacity factor (this "
                              f"model has shared_ffn_dim={args.shared_ffn_dim}, capacity_factor="
                              f"{args.capacity_factor}); export it with --format pt")
    if args.variant == "qwen3_next":
        model_type, arch = "qwen3_next", "Qwen3NextForCausalLM"
    elif args.n_experts:
        model_type, arch = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
    else:
        model_type, arch = "qwen3_5_text", "Qwen3_5ForCausalLM"
    config = decoder_hf.hf_config(args, model_type, arch)
    config.pop("rope_scaling")
    config.pop("rope_theta")
    config.update(rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta,
                                   "partial_rotary_factor": args.partial_rotary_factor},
                  layer_types=list(args.layer_types), full_attention_interval=args.full_attention_interval,
                  linear_num_key_heads=args.linear_n_k_heads, linear_num_value_heads=args.linear_n_v_heads,
                  linear_key_head_dim=args.linear_k_head_dim, linear_value_head_dim=args.linear_v_head_dim,
                  linear_conv_kernel_dim=args.linear_conv_kernel)
    if args.n_experts:
        config.update(num_experts=args.n_experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_ffn_dim,
                      shared_expert_intermediate_size=args.shared_ffn_dim,
                      router_aux_loss_coef=args.router_aux_loss_coef, output_router_logits=False)
        if args.variant == "qwen3_next":
            config.update(norm_topk_prob=args.norm_topk_prob, decoder_sparse_step=args.decoder_sparse_step,
                          mlp_only_layers=list(args.mlp_only_layers))
        else:
            config.pop("intermediate_size")
    elif args.variant == "qwen3_next":
        config["num_experts"] = 0
    return config

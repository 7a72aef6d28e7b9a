"""DeepSeek-V3.2 weights and config between ours and Hugging Face's (DeepseekV32ForCausalLM, and GLM-5's
GlmMoeDsaForCausalLM for model.variant = "glm_moe_dsa").

DeepSeek-V3's mapping (models/deepseek_v3/hf.py) plus each layer's lightning indexer, one to one:
  layers.N.attention.indexer.{wq_b, wk, weights_proj}.weight <-> model.layers.N.self_attn.indexer.{wq_b, wk,
                                                                 weights_proj}.weight
  layers.N.attention.indexer.k_norm.{weight, bias}           <-> model.layers.N.self_attn.indexer.k_norm.{weight,
                                                                 bias}
A checkpoint without a layer's indexer (a DeepSeek-V3 checkpoint under a deepseek_v32 config) is refused: its
attention would have nothing to select keys with; so is an indexer in a layer that reuses another's selection
(GLM-5's "shared" layers hold none). The published multi-token-prediction layer is set aside. A glm_moe_dsa
config.json gives each layer's indexer type by indexer_types, or by index_topk_pattern / index_topk_freq /
index_skip_topk_offset, read as transformers' GlmMoeDsaConfig reads them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_npu.errors import CheckpointError
from titan_npu.models.decoder.args import matching_flavor
from titan_npu.models.deepseek_v3 import hf as v3
from titan_npu.models.deepseek_v3.args import DEEPSEEK_OVERRIDABLE, YARN_FIELDS
from titan_npu.models.deepseek_v32.args import FLAVORS, FULL, SHARED, VARIANTS, DSAArgs

StateDict = dict[str, torch.Tensor]
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
_OUR_INDEXER = re.compile(r"layers\.(\d+)\.attention\.indexer\.(.+)")
_HF_INDEXER = re.compile(r"model\.layers\.(\d+)\.self_attn\.indexer\.(.+)")
# The fields of DeepSeek-V3's config.json that a deepseek_v32 one does not carry (transformers 5.25's
# DeepseekV32Config drops rope_interleave: its MLA always rotates interleaved pairs).
_V3_ONLY = ("rope_interleave", "num_nextn_predict_layers")
MODEL_TYPES = VARIANTS  # each variant is its own model_type
ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def hf_name(key: str) -> str:
    """Our parameter name -> its Hugging Face name."""
    match = _OUR_INDEXER.fullmatch(key)
    if match is not None and match.group(2) in INDEXER:
        return f"model.layers.{match.group(1)}.self_attn.indexer.{match.group(2)}"
    return v3.hf_name(key)


def to_hf(state_dict: StateDict, args: DSAArgs) -> StateDict:
    """Our state dict -> Hugging Face's names (experts one tensor each, indexers one to one)."""
    indexers = {k: v for k, v in state_dict.items() if _OUR_INDEXER.fullmatch(k)}
    rest = v3.to_hf({k: v for k, v in state_dict.items() if k not in indexers}, args)
    return {**rest, **{hf_name(k): v for k, v in indexers.items()}}


def from_hf(hf_state_dict: StateDict, args: DSAArgs, *, tie_word_embeddings: bool = False) -> StateDict:
    """A Hugging Face state dict -> ours; a CheckpointError when a layer's indexer is missing or partial."""
    ours, held = {}, {}
    for key, tensor in hf_state_dict.items():
        match = _HF_INDEXER.fullmatch(key)
        if match is None:
            continue
        layer, name = int(match.group(1)), match.group(2)
        if layer >= args.n_layers:  # the multi-token-prediction layer's indexer, set aside with that layer
            continue
        if name not in INDEXER:
            raise CheckpointError(f"Hugging Face key '{key}' has no counterpart in a DeepSeek-V3.2 indexer")
        ours[f"layers.{layer}.attention.indexer.{name}"] = tensor
        held.setdefault(layer, set()).add(name)
    for layer in range(args.n_layers):
        if not args.has_indexer(layer):
            if layer in held:
                raise CheckpointError(f"the checkpoint holds an indexer in layer {layer} (model.layers.{layer}."
                                      f"self_attn.indexer.*) but config.json's indexer_types makes it reuse layer "
                                      f"{args.selection_source(layer)}'s selection; the two disagree")
            continue
        missing = [name for name in INDEXER if name not in held.get(layer, set())]
        if missing:
            raise CheckpointError(
                f"the checkpoint lacks the lightning indexer's weights of layer {layer} (model.layers.{layer}."
                f"self_attn.indexer.{missing[0]}{' and more' if len(missing) > 1 else ''}): a DeepSeek-V3.2 model "
                f"needs them; import a DeepSeek-V3.2 checkpoint, or this one as model_type deepseek_v3")
    rest = {k: v for k, v in hf_state_dict.items() if not _HF_INDEXER.fullmatch(k)}
    return {**v3.from_hf(rest, args, tie_word_embeddings=tie_word_embeddings), **ours}


def from_hf_layout(key: str, tensor: torch.Tensor, args: DSAArgs) -> torch.Tensor:
    """A Hugging Face tensor under our name: the same layout (fp8 refused, as DeepSeek-V3's)."""
    return v3.from_hf_layout(key, tensor, args)


def indexer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's indexer type from a glm_moe_dsa config.json, as transformers' GlmMoeDsaConfig derives it."""
    if config.get("indexer_types"):
        return list(config["indexer_types"])
    pattern = config.get("index_topk_pattern")
    if pattern:
        return [{"F": FULL, "S": SHARED}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(config.get("index_topk_freq") or 1), 1)
    offset = int(config.get("index_skip_topk_offset", 2))
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED
            for i in range(int(config.get("num_hidden_layers", 0)))]


def args_from_hf_config(config: dict[str, Any]) -> DSAArgs:
    """The args of a DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM config.json (DeepSeek-V3's fields, the
    indexer's and GLM-5's layer pattern), refusing what the model cannot be."""
    model_type = config.get("model_type", "deepseek_v32")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"config.json model_type='{model_type}' is not one of {', '.join(MODEL_TYPES)}")
    missing = [k for k in ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank") if not config.get(k)]
    if missing:
        raise CheckpointError(f"config.json lacks {', '.join(missing)}; a {model_type} config sets the lightning "
                              f"indexer's shapes and a query latent")
    types = None
    if model_type == "glm_moe_dsa":
        if config.get("indexer_rope_interleave") is False:
            raise CheckpointError("config.json has indexer_rope_interleave=false; glm_moe_dsa here means the "
                                  "indexer's RoPE on interleaved pairs, as transformers' GlmMoeDsaIndexer applies it")
        types = indexer_types(config)
        types = None if all(t == FULL for t in types) else types
    base = v3.args_from_hf_config({**{k: v for k, v in config.items() if k not in _V3_ONLY},
                                   "model_type": "deepseek_v3"})
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__ if k not in ("mtp_depth", "flavor")}
    try:
        args = DSAArgs(**{**fields, "family": "deepseek_v32"}, index_n_heads=int(config["index_n_heads"]),
                       index_head_dim=int(config["index_head_dim"]), index_topk=int(config["index_topk"]),
                       variant=model_type, indexer_types=types)
    except Exception as e:
        raise CheckpointError(f"config.json describes a model that cannot be built: {e}") from e
    args.flavor = matching_flavor(
        args, {name: {**preset, "head_dim": preset["qk_nope_head_dim"] + preset["qk_rope_head_dim"]}
               for name, preset in FLAVORS.items()},
        own=(*(k for k in DEEPSEEK_OVERRIDABLE if k not in ("mtp_depth", "mtp_loss_coef")), *YARN_FIELDS,
             "index_n_heads", "index_head_dim", "index_topk", "variant", "indexer_types"))
    return args


def hf_config(args: DSAArgs) -> dict[str, Any]:
    """config.json of the Hugging Face model of args.variant with these shapes (GLM-5's with its indexer_types)."""
    config = {k: v for k, v in v3.hf_config(args).items() if k not in _V3_ONLY}
    config.update({"architectures": [ARCHITECTURES[args.variant]], "model_type": args.variant,
                   "index_n_heads": args.index_n_heads, "index_head_dim": args.index_head_dim,
                   "index_topk": args.index_topk})
    if args.variant == "glm_moe_dsa":
        config["indexer_types"] = args.indexer_types or [FULL] * args.n_layers
    return config

"""The parts of a ModelSpec every dense-decoder family shares: the model, its parallel plan, pipeline split,
parameter table and Hugging Face weight mapping. A family adds its flavors, names and config.json mapping."""

from __future__ import annotations

from typing import Any

from titan_npu.models.decoder import hf
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.decoder.cost import block_costs
from titan_npu.models.decoder.model import Transformer
from titan_npu.models.decoder.parallelize import parallelize_decoder
from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.decoder.sharding import parameter_kinds
from titan_npu.models.spec import HFAdapter


def permuted_block(name: str, args: DecoderArgs) -> int:
    """Rows of our tensor `name` that its Hugging Face counterpart permutes among themselves: one head for q/k
    projections and their biases, the whole (one-head) q/k norm; 1 (no permutation) for every other tensor."""
    kind = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if kind in ("attention.wq.weight", "attention.wq.bias", "attention.wk.weight", "attention.wk.bias",
                "attention.q_norm.weight", "attention.k_norm.weight"):
        return args.head_dim
    return 1


def decoder_parts() -> dict[str, Any]:
    """The ModelSpec fields a dense-decoder family takes as they are."""
    return dict(build_model=Transformer, parallelize=parallelize_decoder, split_layers=split_layers,
                build_stage=build_stage, parameter_kinds=parameter_kinds, args_from_dict=args_from_dict,
                block_costs=block_costs)


def args_from_dict(fields: dict[str, Any]) -> DecoderArgs:
    """DecoderArgs from a checkpoint's stored fields (older checkpoints lack the newer fields: their defaults)."""
    known = DecoderArgs.__dataclass_fields__
    return DecoderArgs(**{k: v for k, v in fields.items() if k in known})


def decoder_hf_adapter(model_types: tuple[str, ...], args_from_config, config) -> HFAdapter:
    """A family's HFAdapter: its config.json mapping around the decoder's shared weight mapping."""
    return HFAdapter(model_types=model_types, args_from_config=args_from_config, config=config, to_hf=hf.to_hf,
                     from_hf=hf.from_hf, hf_name=hf.hf_name, from_hf_layout=hf.from_hf_layout,
                     permuted_block=permuted_block)

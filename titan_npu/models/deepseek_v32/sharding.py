"""Every kind of parameter of a DeepSeek-V3.2 model with its full shape and tensor-parallel dim: DeepSeek-V3's
(models/deepseek_v3/sharding.py) and, after the attention's, its lightning indexer's (replicated: None)."""

from __future__ import annotations

from titan_npu.models.deepseek_v3.sharding import parameter_kinds as v3_parameter_kinds
from titan_npu.models.deepseek_v32.args import DSAArgs


def parameter_kinds(args: DSAArgs) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each kind of parameter -> (full shape, tensor-parallel dim), in the model's order."""
    h, d = args.index_n_heads, args.index_head_dim
    indexer = {"attention.indexer.wq_b.weight": (h * d, args.q_lora_rank), "attention.indexer.wk.weight": (d, args.dim),
               "attention.indexer.k_norm.weight": (d,), "attention.indexer.k_norm.bias": (d,),
               "attention.indexer.weights_proj.weight": (h, args.dim)}
    kinds = {}
    for kind, value in v3_parameter_kinds(args).items():
        kinds[kind] = value
        if kind == "attention.wo.weight":
            kinds.update({name: (shape, None) for name, shape in indexer.items()})
    return kinds


def holds_kind(args: DSAArgs, layer_id: int, kind: str) -> bool:
    """Whether block `layer_id` holds parameters of `kind`: a layer without an indexer holds none of its kinds."""
    return ".indexer." not in kind or args.has_indexer(layer_id)

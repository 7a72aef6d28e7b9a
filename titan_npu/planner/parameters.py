"""Exact parameter, gradient and optimizer-state bytes of a rank.

The planner walks the same parameter shapes and tensor-parallel placements (the family's
ModelSpec.parameter_kinds: biases, q/k norms and a tied output included), pipeline split and FSDP2 dim-0 chunking
as the real parallelized model; the dry run (planner/verify.py) checks that they are equal, shard by shard.
A MoE layer's stacked experts (dim 0 = the experts) are split differently under expert parallelism: over the ep
ranks first (whole experts, parallel.ep_degree, taken from dp_shard x cp), then by FSDP over the ranks that hold
the same experts (dp_shard x cp / ep of them, or the HSDP replicas when ep takes every FSDP rank); dense parameters
are FSDP-sharded over dp_shard (x cp). Under tensor parallelism each expert is cut on its ffn dim first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from titan_npu.errors import LayoutError
from titan_npu.lora.apply import eligible_name, matches
from titan_npu.models.registry import spec_of
from titan_npu.parallel.arithmetic import chunk_size, expert_coordinates
from titan_npu.parallel.float8 import converts, converts_experts
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.stages import FIRST_STAGE_KINDS, LAST_STAGE_KINDS, rank_parts
from titan_npu.trainer.optimizer import takes_muon

# Per-parameter optimizer state, in parameter-sized tensors (the dry run measures the real optimizer's). Muon: a
# momentum buffer on the matrices it takes; the parameters it leaves to AdamW keep AdamW's two moments.
OPTIMIZER_STATE_MULTIPLIER = {"adamw": 2, "adam": 2, "sgd": 1, "muon": 1}
# Bytes of one element of Adam's moments per optimizer.state_dtype (trainer/state_dtype.py).
MOMENT_BYTES = {"fp32": 4, "bf16": 2}


def parameter_kinds(args: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of each kind of parameter the model has (its family's table), in the model's order: the block
    ones by their name inside a block, the root ones by their own."""
    return {kind: shape for kind, (shape, _) in spec_of(args).parameter_kinds(args).items()}


def tensor_parallel_dims(args: Any) -> dict[str, int | None]:
    """The dim tensor parallelism splits each kind of parameter along (None = replicated)."""
    return {kind: dim for kind, (_, dim) in spec_of(args).parameter_kinds(args).items()}


def block_kinds(args: Any) -> list[str]:
    """The kinds of parameter one block holds, in the model's order (a rank's parameter names follow it)."""
    return [k for k in parameter_kinds(args) if k not in FIRST_STAGE_KINDS + LAST_STAGE_KINDS]


# A dense block's SwiGLU; a model with both kinds of layer (dense first blocks, or layers kept dense)
# holds these in its dense blocks and the MoE layer's router, experts and shared experts in the others.
DENSE_FFN_KINDS = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def layer_kinds(args: Any, layer_id: int) -> list[str]:
    """The kinds of parameter block `layer_id` holds, in the model's order: a MoE block's feed-forward kinds or a
    dense block's, the rest alike."""
    return layers_kinds(args, [layer_id])[layer_id]


def layers_kinds(args: Any, layer_ids: Iterable[int]) -> dict[int, list[str]]:
    """layer_kinds of each of `layer_ids`, the family's table built once (a search sizes thousands of layouts of
    up to a hundred blocks each)."""
    kinds = block_kinds(args)
    spec = spec_of(args)
    experts, holds = spec.experts, spec.layer_holds
    if experts is None:
        by_layer = {i: kinds for i in layer_ids}
    else:
        by_kind = {moe: [k for k in kinds if not k.startswith("feed_forward.") or (k in DENSE_FFN_KINDS) != moe]
                   for moe in (False, True)}
        by_layer = {i: by_kind[bool(experts.moe_block(args, i))] for i in layer_ids}
    return {i: [k for k in ks if holds(args, i, k)] for i, ks in by_layer.items()}


def is_expert_kind(kind: str) -> bool:
    """Whether a kind of parameter is a MoE layer's stacked experts (dim 0 = the experts)."""
    return kind.startswith("feed_forward.experts.")


def parameter_kind(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'attention.wq.weight'; root parameters are their own kind."""
    return name.split(".", 2)[-1] if name.startswith("layers.") else name



def float8_kinds(job: Job) -> set[str]:
    """The kinds of parameter that are weights of float8 linears (parallel/float8.py's rule on their shapes): 2-D
    weights but the embedding table; none without float8.enable."""
    if job.float8 is None:
        return set()
    kinds = set()
    for kind, shape in parameter_kinds(job.args).items():
        if len(shape) != 2 or not kind.endswith(".weight") or kind == "tok_embeddings.weight":
            continue
        module = kind.removesuffix(".weight")
        fqn = module if kind in FIRST_STAGE_KINDS + LAST_STAGE_KINDS else f"layers.0.{module}"
        if converts(fqn, shape[0], shape[1], job.float8):
            kinds.add(kind)
    return kinds


def float8_expert_kinds(job: Job) -> set[str]:
    """The kinds of parameter that are stacked weights of routed experts whose grouped GEMMs run in float8
    (float8.moe_experts; parallel/float8.py's rule on their shapes, named as the first MoE layer's experts)."""
    experts = spec_of(job.args).experts
    if job.float8 is None or experts is None or not experts.n_moe_blocks(job.args):
        return set()
    shapes = parameter_kinds(job.args)
    weights = [k for k in ("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3")
               if k in shapes]
    if not weights:
        return set()
    _, ffn_dim, dim = shapes["feed_forward.experts.w1"]
    first = next(i for i in range(job.args.n_layers) if experts.moe_block(job.args, i))
    return set(weights) if converts_experts(f"layers.{first}.feed_forward.experts", dim, ffn_dim, job.float8) else set()


def rank_parameter_names(args: Any, layout: Layout, pp_rank: int) -> list[str]:
    """Names of the parameters a pipeline rank holds (layer names stay global: 'layers.41.attention.wq.weight')."""
    names = []
    kinds = parameter_kinds(args)
    for part in rank_parts(args, layout, pp_rank):
        per_layer = layers_kinds(args, part.layers)
        names += [f"layers.{i}.{kind}" for i in part.layers for kind in per_layer[i]]
        names += part.root_kinds(kinds)
    return names



def local_shape(shape: tuple[int, ...], tp_dim: int | None, layout: Layout, coords: dict[str, int],
                expert: bool = False) -> tuple[int, ...]:
    """The shape of a parameter's local shard on a rank: tensor-parallel cut first (along tp_dim, None = none),
    then FSDP's dim-0 chunk of it; stacked experts (`expert`) under expert parallelism: the ep rank's experts (ep
    consecutive ranks of dp_shard x cp), then FSDP's chunk of those over the ranks that hold the same ones
    (Layout.expert_shards: the efsdp ranks, or the HSDP replicas when ep = dp_shard x cp)."""
    local = list(shape)
    if layout.tp > 1 and tp_dim is not None:
        local[tp_dim] = chunk_size(local[tp_dim], layout.tp, coords["tp"])
    if expert and layout.ep > 1:
        efsdp_rank, ep_rank = expert_coordinates(layout.fsdp_index(coords), layout.ep)
        local[0] = chunk_size(local[0], layout.ep, ep_rank)
        if layout.expert_shards > 1:
            shard_rank = efsdp_rank if layout.efsdp > 1 else coords["dp_replicate"]
            local[0] = chunk_size(local[0], layout.expert_shards, shard_rank)
    elif layout.fsdp_enabled:
        local[0] = chunk_size(local[0], layout.fsdp_shards, layout.fsdp_index(coords))
    return tuple(local)


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of `shape`."""
    n = 1
    for size in shape:
        n *= size
    return n


def _local_numels(args: Any, layout: Layout, coords: dict[str, int]) -> dict[str, int]:
    """Elements of one local shard of each kind of parameter at `coords`."""
    return {kind: numel(local_shape(shape, dim, layout, coords, is_expert_kind(kind)))
            for kind, (shape, dim) in spec_of(args).parameter_kinds(args).items()}


def local_parameter_numels(args: Any, layout: Layout, rank: int) -> dict[str, int]:
    """Elements of every parameter shard that `rank` holds, by name."""
    coords = layout.rank_coordinates(rank)
    per_kind = _local_numels(args, layout, coords)
    return {name: per_kind[parameter_kind(name)] for name in rank_parameter_names(args, layout, coords["pp"])}


def local_numel(args: Any, layout: Layout, rank: int) -> int:
    """Total elements of the parameter shards on `rank` (local_parameter_numels summed, without the names)."""
    return sum(local_numel_split(args, layout, rank))


def local_numel_split(args: Any, layout: Layout, rank: int) -> tuple[int, int]:
    """(dense, expert) elements of the parameter shards on `rank`: FSDP gathers and reduces the two over different
    groups under expert parallelism."""
    coords = layout.rank_coordinates(rank)
    per_kind = _local_numels(args, layout, coords)
    dense = expert = 0
    blocks: dict[tuple[str, ...], tuple[int, int]] = {}  # a block's kinds -> its (dense, expert) elements
    for part in rank_parts(args, layout, coords["pp"]):
        dense += sum(per_kind[k] for k in part.root_kinds(per_kind))
        for kinds in map(tuple, layers_kinds(args, part.layers).values()):
            if kinds not in blocks:
                blocks[kinds] = (sum(per_kind[k] for k in kinds if not is_expert_kind(k)),
                                 sum(per_kind[k] for k in kinds if is_expert_kind(k)))
            dense, expert = dense + blocks[kinds][0], expert + blocks[kinds][1]
    return dense, expert


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the training state one rank holds: fp32 parameter shards, their gradients, optimizer moments."""

    parameters: int
    gradients: int
    optimizer: int
    numel: int


def optimizer_state_multiplier(job: Job) -> int:
    """Optimizer state per parameter, in parameter-sized tensors."""
    name = job.optimizer.lower()
    if name not in OPTIMIZER_STATE_MULTIPLIER:
        raise LayoutError(f"optimizer.name={job.optimizer!r} has no state model (known: AdamW, Adam, SGD, Muon)")
    if name == "sgd" and job.momentum == 0:
        return 0
    return OPTIMIZER_STATE_MULTIPLIER[name]


def muon_kinds(job: Job) -> set[str]:
    """The kinds of parameter Muon takes (optimizer.name = Muon), by the optimizer's own rule on their names (a
    block's as those of layer 0); none under another optimizer."""
    if job.optimizer.lower() != "muon":
        return set()
    roots = FIRST_STAGE_KINDS + LAST_STAGE_KINDS
    return {kind for kind, shape in parameter_kinds(job.args).items()
            if takes_muon(kind if kind in roots else f"layers.0.{kind}", len(shape), job.muon_exclude)}


def _adamw_numel_beside_muon(job: Job, per_name: dict[str, int]) -> int:
    """Elements among `per_name` (name -> elements) that Muon leaves to AdamW (two moments instead of one)."""
    if job.optimizer.lower() != "muon":
        return 0
    muon = muon_kinds(job)
    return sum(n for name, n in per_name.items() if parameter_kind(name) not in muon)


def rank_numel_split(job: Job, layout: Layout, rank: int) -> tuple[int, int]:
    """local_numel_split of the job's model, once per job, rank and layout.sharding (all it follows from)."""
    return job.memo(("numel_split", layout.sharding, rank), lambda: local_numel_split(job.args, layout, rank))


def state_bytes(job: Job, layout: Layout, rank: int) -> StateBytes:
    """Exact parameter/gradient/optimizer bytes on `rank` (the model keeps fp32 parameters and fp32 gradients)."""
    return job.memo(("state_bytes", layout.sharding, rank), lambda: _state_bytes(job, layout, rank))


def _state_bytes(job: Job, layout: Layout, rank: int) -> StateBytes:
    """state_bytes, computed; with LoRA only the adapters have gradients and optimizer state, and only the
    parameters that learn (frozen_kinds aside) otherwise."""
    held = sum(rank_numel_split(job, layout, rank))
    muon = job.optimizer.lower() == "muon"
    if job.lora_rank:
        adapters = {name: numel(shape) for name, shape in adapter_local_shapes(job, layout, rank).items()}
        trained = sum(adapters.values())
        # Muon takes the adapters' matrices unless muon_exclude names them; the others are AdamW's
        adamw = sum(n for name, n in adapters.items() if not takes_muon(name, 2, job.muon_exclude)) if muon else 0
        return StateBytes(4 * (held + trained), 4 * trained, _optimizer_bytes(job, trained, adamw), held + trained)
    per_name = trained_numels(job, layout, rank)
    trained = held if per_name is None else sum(per_name.values())
    adamw = _adamw_numel_beside_muon(job, per_name or local_parameter_numels(job.args, layout, rank)) if muon else 0
    return StateBytes(4 * held, 4 * trained, _optimizer_bytes(job, trained, adamw), held)


def _optimizer_bytes(job: Job, numel: int, adamw_beside_muon: int) -> int:
    """State bytes of `numel` fp32 parameter elements, `adamw_beside_muon` of them left to AdamW by Muon: Adam's
    two moments in optimizer.state_dtype (MOMENT_BYTES), Muon's momentum and SGD's in fp32."""
    multiplier, name = optimizer_state_multiplier(job), job.optimizer.lower()
    moment = MOMENT_BYTES[job.state_dtype]
    if name in ("adamw", "adam"):
        return 2 * moment * numel
    if name == "muon":
        return 4 * (numel - adamw_beside_muon) + 2 * moment * adamw_beside_muon
    return multiplier * 4 * numel


def frozen_kinds(args: Any) -> set[str]:
    """The kinds of parameter the family's training stage freezes (ModelSpec.trains_kind): no gradient, no
    optimizer state."""
    trains = spec_of(args).trains_kind
    return {kind for kind in parameter_kinds(args) if not trains(args, kind)}


def trained_numels(job: Job, layout: Layout, rank: int) -> dict[str, int] | None:
    """Elements of each parameter shard on `rank` that learns, by name; None when every one does."""
    frozen = frozen_kinds(job.args)
    if not frozen:
        return None
    return {name: n for name, n in local_parameter_numels(job.args, layout, rank).items()
            if parameter_kind(name) not in frozen}


def muon_gather_bytes(job: Job, layout: Layout, rank: int) -> int:
    """Bytes `rank` receives per step to orthogonalise its Muon updates (fp32) as whole matrices: every shard of
    a matrix's last two dims is gathered (FSDP's and tensor parallelism's), stacked experts keep their own
    (expert-parallel and FSDP) split of dim 0."""
    return job.memo(("muon_gather", layout.sharding, rank), lambda: _muon_gather_bytes(job, layout, rank))


def _muon_gather_bytes(job: Job, layout: Layout, rank: int) -> int:
    """muon_gather_bytes, computed."""
    if job.lora_rank:  # only the adapters train: each gathered whole
        if job.optimizer.lower() != "muon":
            return 0
        received = 0
        for name, (local, whole) in _adapter_shards(job, layout, rank).items():
            if takes_muon(name, 2, job.muon_exclude):
                received += numel(whole) - numel(local)
        return 4 * received
    muon = muon_kinds(job)
    if not muon:
        return 0
    coords = layout.rank_coordinates(rank)
    kinds, tp_dims = parameter_kinds(job.args), tensor_parallel_dims(job.args)
    received = 0
    for name in rank_parameter_names(job.args, layout, coords["pp"]):
        kind = parameter_kind(name)
        if kind in muon:
            shape = kinds[kind]
            local = local_shape(shape, tp_dims[kind], layout, coords, is_expert_kind(kind))
            received += numel((*local[:-2], *shape[-2:])) - numel(local)
    return 4 * received


def checkpoint_bytes(job: Job) -> int:
    """Size of one training checkpoint: fp32 weights plus optimizer moments, all ranks together."""
    n = job.args.num_params()
    if job.lora_rank:  # the frozen weights, the adapters and their optimizer state
        names = [f"layers.{i}.{kind}" for i, kinds in layers_kinds(job.args, range(job.args.n_layers)).items()
                 for kind in kinds]
        shapes = parameter_kinds(job.args)
        trained = sum(job.lora_rank * sum(shapes[parameter_kind(name)]) for name in adapted_weights(job, names))
        return 4 * n + 4 * trained + _optimizer_bytes(job, trained, 0)
    adamw = n - _muon_numel(job) if job.optimizer.lower() == "muon" else 0
    frozen, shapes = frozen_kinds(job.args), parameter_kinds(job.args)
    per_layer = layers_kinds(job.args, range(job.args.n_layers)) if frozen else {}
    trained = n - sum(numel(shapes[kind]) for kinds in per_layer.values() for kind in kinds if kind in frozen) - sum(
        numel(shapes[kind]) for kind in FIRST_STAGE_KINDS + LAST_STAGE_KINDS if kind in frozen and kind in shapes)
    return 4 * n + _optimizer_bytes(job, trained, adamw)


def _muon_numel(job: Job) -> int:
    """Elements of the whole model that Muon takes."""
    muon, shapes = muon_kinds(job), parameter_kinds(job.args)
    per_layer = layers_kinds(job.args, range(job.args.n_layers))
    blocks = sum(numel(shapes[kind]) for kinds in per_layer.values() for kind in kinds if kind in muon)
    return blocks + sum(numel(shapes[kind]) for kind in FIRST_STAGE_KINDS + LAST_STAGE_KINDS if kind in muon)


# LoRA's adapters (titan_npu/lora/apply.py's rule: a block's linear weight whose module a target pattern names, not a
# router's gate nor stacked experts); A [r, in] and B [out, r] cut as parallel/adapters.py places them under tensor
# parallelism (B by rows under a column-parallel weight, A by columns under a row-parallel one), then by FSDP's
# dim-0 chunk as every parameter.


def adapted_weights(job: Job, names: list[str]) -> list[str]:
    """The weights among `names` (a rank's parameter names) that carry an adapter under the job's [lora]."""
    if not job.lora_rank:
        return []
    kinds = parameter_kinds(job.args)
    adapted = []
    for name in names:
        kind = parameter_kind(name)
        module = name.removesuffix(".weight")
        if (name.startswith("layers.") and name.endswith(".weight") and len(kinds[kind]) == 2
                and not is_expert_kind(kind) and eligible_name(module)
                and any(matches(module, p) for p in job.lora_targets)):
            adapted.append(name)
    return adapted


def adapter_local_shapes(job: Job, layout: Layout, rank: int) -> dict[str, tuple[int, ...]]:
    """Every adapter `rank` holds ('layers.0.attention.wq.lora_A') -> its local shard's shape."""
    return {name: local for name, (local, _) in _adapter_shards(job, layout, rank).items()}


def _adapter_shards(job: Job, layout: Layout, rank: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every adapter `rank` holds -> (its local shard's shape, its whole shape)."""
    return job.memo(("adapter_shards", layout.sharding, rank), lambda: _compute_adapter_shards(job, layout, rank))


def _compute_adapter_shards(job: Job, layout: Layout, rank: int
                            ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    coords = layout.rank_coordinates(rank)
    kinds, tp_dims = parameter_kinds(job.args), tensor_parallel_dims(job.args)
    shapes = {}
    for name in adapted_weights(job, rank_parameter_names(job.args, layout, coords["pp"])):
        kind = parameter_kind(name)
        out_features, in_features = kinds[kind]
        module = name.removesuffix(".weight")
        tp_dim = tp_dims[kind]
        a, b = (job.lora_rank, in_features), (out_features, job.lora_rank)
        shapes[f"{module}.lora_A"] = (local_shape(a, 1 if tp_dim == 1 else None, layout, coords), a)
        shapes[f"{module}.lora_B"] = (local_shape(b, 0 if tp_dim == 0 else None, layout, coords), b)
    return shapes

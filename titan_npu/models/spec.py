"""ModelSpec: everything the framework needs to know about one model family, in one object.

The trainer, parallel/, checkpoint/, the planner, dry run, generate, bench and export/import reach a family only
through its spec (models/registry.py looks it up by `model.name`, or by a Hugging Face config's `model_type`), so
a new family is a folder under models/ and one registry entry. A spec holds functions, not a class hierarchy: a
family fills it from its own modules, and families that share an architecture share those functions.

The args object a spec builds is the family's own dataclass; the framework reads these fields of it: dim, n_layers,
n_heads, n_kv_heads, head_dim, vocab_size, max_seq_len, norm_eps, rope_theta, rope_scaling_factor,
use_flash_attention, tie_embeddings, family, flavor, and the methods num_params(exclude_embedding),
num_active_params(exclude_embedding) (what a token meets: MFU counts these) and num_flops_per_token(seq_len).
A model that routes tokens (MoE) has auxiliary_loss() and routing_metrics() (trainer/routing.py), and one whose
routers carry a score bias has score_biases() (its layer ids -> bias tensors); its args have is_moe_layer(layer_id),
n_moe_layers and moe_args() (models/moe/args.py's MoEArgs), the shared MoE block's interface, which its spec's
`experts` (ExpertTerms, models/moe/cost.py) turns into the planner's expert terms (which blocks route, the experts
an ep degree divides, the all-to-alls' copies and width, the grouped GEMMs' share).

Everything else family-specific that the framework needs is a field below: the planner's activation and FLOPs terms
(block_costs, training_flops; models/<family>/cost.py), import's printed [model] keys (model_lines), generate's
refusal, the checkpoint check's extra blocks. tests/structure/test_family_ownership.py holds the rule: no module
outside models/ names a family or a field only one family's args have.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from titan_npu.errors import ConfigError

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CostSite:
    """Where a block runs, as far as its cost terms go (the planner fills it per layout and device type)."""

    compute_bytes: int  # c: bytes of one value in the compute dtype
    tp: int  # tensor-parallel degree: heads and ffn dims are a rank's share
    expert_parallel: bool  # whether expert parallelism regroups the routed copies (ep > 1)
    device_type: str  # "cpu", "cuda", "npu", ...
    # Tokens of one training sequence: the keys a token's scores cover, for terms that grow with it (a score per
    # key kept for backward, as eager attention's probabilities); 0 where no sequence is given.
    seq_len: int = 0


@dataclass(frozen=True)
class TokenBytes:
    """Per token, what one part of a block keeps for backward (sizes a tensor-parallel rank's)."""

    saved: int  # every tensor autograd saves (no checkpointing)
    op_saves: int  # what op-level selective checkpointing keeps
    transient: int = 0  # gradients alive beyond the saved tensors while the block's backward runs


@dataclass(frozen=True)
class CostTerm:
    """One part of a block (its token mixer or its feed-forward) as the planner counts it: a name that tells the
    kinds apart, and its per-token bytes (args, CostSite) -> TokenBytes."""

    name: str
    bytes: Callable[[Any, CostSite], TokenBytes]


@dataclass(frozen=True)
class BlockCost:
    """One block's cost terms: its token mixer and its feed-forward (the planner adds the norms, the residual stream
    and, for softmax attention, the kernel's q, k, v, output and statistics, eager probabilities and context
    parallelism's tensors)."""

    mixer: CostTerm
    ffn: CostTerm
    # Softmax attention over args.q_dim / kv_dim wide q and k/v (the kernel's tensors are the planner's); False: a
    # mixer whose TokenBytes are all it keeps (a linear-attention block).
    softmax: bool = True
    # Softmax attention that runs the plain path whatever use_flash_attention says (sinks): it keeps the B H S^2
    # probabilities as eager attention does.
    eager: bool = False

    @property
    def kind(self) -> tuple[str, str]:
        """(mixer, feed-forward) names: blocks of one kind cost the same."""
        return self.mixer.name, self.ffn.name


@dataclass(frozen=True)
class ExpertTerms:
    """A routed-experts feed-forward as the planner counts it (models/moe/cost.py fills it from the shared MoE
    block's args): which blocks route, how many experts and copies, what expert parallelism's all-to-alls carry.
    Every function takes the family's args."""

    moe_block: Callable[[Any, int], bool]  # (args, layer id) -> whether the block's feed-forward routes tokens
    n_moe_blocks: Callable[[Any], int]  # how many blocks route (0: none, a dense flavor of a MoE family)
    n_routed: Callable[[Any], int]  # routed experts per MoE layer (an expert-parallel degree divides it)
    routed_copies: Callable[[Any], int]  # the experts each token is routed to: its copies per MoE layer
    all_to_all_width: Callable[[Any], int]  # values of one routed copy that the all-to-alls send (the model width)
    # the routed experts' matmul weights one token meets over every MoE layer (copies x 3 D F per layer)
    routed_active_params: Callable[[Any], int]
    describe: Callable[[Any], str]  # plan's line on the MoE layers ("48 MoE layers of 128 experts (top 8, ...)")


@dataclass(frozen=True)
class HFAdapter:
    """How the family's weights and config map to and from a Hugging Face model directory."""

    model_types: tuple[str, ...]  # config.json model_type values this family reads ("qwen3")
    args_from_config: Callable[[dict[str, Any]], Any]  # config.json -> args (refusing what the model cannot be)
    config: Callable[[Any], dict[str, Any]]  # args -> config.json (tokenizer ids and dtype are the caller's)
    to_hf: Callable[[StateDict, Any], StateDict]  # our state dict -> HF names and layouts
    from_hf: Callable[..., StateDict]  # (HF state dict, args, tie_word_embeddings=) -> ours
    hf_name: Callable[[str], str]  # one of our parameter names -> its HF name
    from_hf_layout: Callable[[str, torch.Tensor, Any], torch.Tensor]  # (our name, HF tensor, args) -> our layout
    # The dims of our tensor whose HF counterpart is a permutation within whole blocks of this many entries: a
    # slice of ours is read from HF as the slice rounded out to whole blocks, then permuted and cut (q/k heads).
    permuted_block: Callable[[str, Any], int] = lambda name, args: 1
    # A tensor of ours that stacks several HF tensors along dim 0 (MoE experts) -> their HF names in order; None for
    # one HF holds whole (hf_name then names it).
    stacked_names: Callable[[str, Any], list[str] | None] = lambda name, args: None
    # (the state dict from_hf gave, config.json's args) -> the weights and args of the model they fill, and one line
    # on what config.json asks for that they lack (None when nothing): DeepSeek-V3's multi-token-prediction layers.
    held_model: Callable[[StateDict, Any], tuple[StateDict, Any, str | None]] = lambda sd, args: (sd, args, None)
    # Whether each of our tensors is one HF tensor's slice in a layout from_hf_layout / stacked_names describe, so
    # a rank reads only its shards of a safetensors directory (checkpoint/hf_slices.py); False: the directory is
    # read whole, then converted (gpt-oss's experts: fused, interleaved and MXFP4-quantised in HF's files).
    shard_wise: bool = True


@dataclass(frozen=True)
class ModelSpec:
    """One model family (a `model.name`): its shapes, its model, how it is parallelised, split and converted."""

    name: str  # model.name, e.g. "qwen3"
    description: str  # one line for listings ("Qwen3 dense (0.6B-32B)")
    flavors: Mapping[str, Mapping[str, Any]]  # flavor -> the args fields it sets
    # The spellings of model.name that mean this family (full match, case-insensitive); group "size" picks a flavor.
    name_pattern: re.Pattern
    build_args: Callable[[Any, str], Any]  # (ModelConfig, canonical flavor) -> args
    # The family's own [model] keys (all but the shared ones of config/schema.py's ModelConfig) -> the row of each
    # (titan_npu/knobs.py's Knob: the values it accepts, its type as `kind`), in the order a saved config lists them;
    # build_args reads them from the ModelConfig (unset: None, the flavor's value). Another key is refused.
    model_keys: Mapping[str, Any]
    build_model: Callable[[Any], nn.Module]  # args -> the whole model (built under torch.device("meta") by callers)
    parallelize: Callable[[nn.Module, Any, Any], nn.Module]  # (model or stage, ParallelDims, JobConfig) -> model
    # (n_layers, n_stages, leftovers) -> layer ids per pipeline stage; leftovers: the stages that take the layers an
    # even split leaves over, in order (parallel/arithmetic.py's leftover_stages for the schedule; None: its default)
    split_layers: Callable[..., list[list[int]]]
    build_stage: Callable[[nn.Module, list[int], bool, bool], nn.Module]  # (model, layers, first, last) -> stage
    # args -> {parameter kind: (full shape, tensor-parallel dim or None)}; a block parameter's kind is its name
    # inside the block ("attention.wq.weight"), a root one's its own name; the planner sizes every shard from it.
    parameter_kinds: Callable[[Any], dict[str, tuple[tuple[int, ...], int | None]]]
    # The planner's activation terms: args -> each block's BlockCost in layer order (a hybrid's linear and
    # full-attention blocks, a MoE model's dense and MoE ones differ; models/decoder/cost.py has the dense decoder's).
    block_costs: Callable[[Any], list[BlockCost]]
    # Whether block `layer_id` holds a parameter of this kind as far as its token mixer goes: (args, layer id, kind);
    # a hybrid's linear and full-attention blocks hold different kinds (the feed-forward's follow is_moe_layer).
    layer_holds: Callable[[Any, int, str], bool] = lambda args, layer_id, kind: True
    hf: HFAdapter | None = None
    # args as a checkpoint's info stores them (dataclasses.asdict) -> args
    args_from_dict: Callable[[dict[str, Any]], Any] = dict
    # Meta's consolidated.*.pth reader: (params.json, model-parallel shard state dicts in order) -> (ours, args).
    read_meta: Callable[[dict[str, Any], list[StateDict]], tuple[StateDict, Any]] | None = None
    # (dim, n_layers) of published sizes: a bare family name with these dims in the config means that flavor.
    published_sizes: Mapping[tuple[int, int], str] = field(default_factory=dict)
    # A flavor named by a version in model.name ("llama3.1_8b" -> "3.1-8B"): (version, size) -> flavor.
    versioned_flavor: Callable[[str | None, str | None], str | None] = lambda version, size: size
    # The family's own layout refusals beyond parallel/layout.py's: (ParallelDims, args, JobConfig) -> None or
    # LayoutError; parallelize calls it, and the planner's search through it skips what the model would refuse.
    check_layout: Callable[[Any, Any, Any], None] = lambda dims, args, cfg: None
    # A context in which the model parts' MoE layers exchange tokens with balanced routing's split sizes (the dry
    # run's fake tensors hold no routed counts): (model parts) -> context manager; a dense model has nothing to swap.
    balanced_routing: Callable[[list[nn.Module]], AbstractContextManager] = lambda parts: contextlib.nullcontext()
    # Aux-loss-free balancing's step of one MoE layer's router score bias, in place: (bias, tokens per expert, rate);
    # None for a family without score biases (trainer/routing.py).
    update_score_bias: Callable[[torch.Tensor, torch.Tensor, float], None] | None = None
    # (args, seq_len) -> training FLOPs per token, the planner's step-time count; None: the standard one,
    # metrics/throughput.py's 6 N + 12 L D S with N the active non-embedding parameters.
    training_flops: Callable[[Any, int], float] | None = None
    # (args) -> the router score bias's step size of aux-loss-free balancing (0: none); trainer/routing.py.
    bias_update_rate: Callable[[Any], float] = lambda args: 0.0
    # (args) -> (how many blocks the model has beyond n_layers, the [model] key that sets that count: DeepSeek-V3's
    # multi-token prediction), or None for a family without such blocks; a checkpoint may hold another count of
    # them (checkpoint/fit.py says which key fits it).
    extra_blocks: Callable[[Any], tuple[int, str] | None] = lambda args: None
    # (args) -> the [model] keys `titan-npu import` prints beyond the decoder's, as (key, value) pairs in order.
    model_lines: Callable[[Any], list[tuple[str, Any]]] = lambda args: []
    # (args) -> None when tools/generate.py can decode with this model, else the one line that says why not.
    generate_refusal: Callable[[Any], str | None] = lambda args: None
    # (args, parameter kind) -> whether parameters of that kind learn (False: frozen by the family's training stage,
    # requires_grad False: no gradient, no optimizer state; the planner counts them as the model builds them).
    trains_kind: Callable[[Any, str], bool] = lambda args, kind: True
    # The routed experts' planner terms (the MoE block's: models/moe/cost.py's MOE_EXPERTS); None for a family
    # without MoE layers. The planner reads a MoE model's routing only through these.
    experts: ExpertTerms | None = None

    def canonical_flavor(self, flavor: str) -> str:
        """The flavor's own spelling ('8b' -> '8B'), or a ConfigError naming the valid ones."""
        for known in self.flavors:
            if known.lower() == flavor.strip().lower():
                return known
        raise ConfigError(f"model.flavor='{flavor}' is not a {self.name} flavor (valid: {', '.join(self.flavors)})")

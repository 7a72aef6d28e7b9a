"""How a dense decoder is parallelised, applied from outside the model: tensor parallel plan, then activation
checkpointing, torch.compile per block, and data parallelism (FSDP / HSDP / replicate) last. float8 linears
(converted before any of this, parallel/parallelize.py) take torchao's float8 styles in the plan.

Tensor parallel (Megatron-style, with sequence parallelism):
  tok_embeddings  vocab-parallel (row-wise), output sharded on the sequence
  attention_norm / ffn_norm / norm   sequence parallel (each rank normalises its slice of the sequence)
  attention.wq/wk/wv, feed_forward.w1/w3   column-wise (each rank holds whole heads / a slice of the FFN), their
                                           biases (Qwen2) cut the same way
  attention.q_norm/k_norm                  per-head norms (Qwen3): over the local heads, the weight replicated and
                                           its gradient summed over the tensor-parallel ranks
  attention.wo, feed_forward.w2            row-wise, reduce-scattered back onto the sequence
  output          column-wise over the vocabulary; with loss parallel the logits stay sharded into the loss
A tied output projection shares the embedding's parameter; both are cut by vocabulary, so the one DTensor serves
both. The dim each parameter ends up split along is sharding.py's table, which the memory planner and the Meta
checkpoint reader use; the dry run (planner/dry_run.py) checks the planner's shards against this plan's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from titan_npu.models.decoder.model import FeedForward
from titan_npu.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_npu.parallel.activation_offload import apply_activation_offload
from titan_npu.parallel.adapters import place_adapters
from titan_npu.parallel.compile import apply_compile
from titan_npu.parallel.context_parallel import context_for
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.float8 import float8_plan
from titan_npu.parallel.fsdp import apply_data_parallel
from titan_npu.parallel.tp_grads import request_grads_in_param_layout

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def _fresh_output(module: nn.Module, args: tuple, output):
    return output.clone()


def parallelize_root(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The tensor-parallel plan of the decoder's root: the embedding's rows, the final norm sequence-parallel, the
    output's columns (vocab-sharded logits under loss parallelism); then the tied output re-tied."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # Pipeline stages have no embedding (all but the first) or no norm/output (all but the last).
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name, None) is not None}
    parallelize_module(model, tp_mesh, float8_plan(model, root_plan))
    model.tie_weights()  # each style replaced its module's parameter with a DTensor of its own


def block_tp_plan(projections: dict[str, Any], dense_feed_forward: bool,
                  local_attention_input: bool = False) -> dict[str, Any]:
    """A decoder block's tensor-parallel plan around its attention's input projections (`projections`, a family's
    own): the norms sequence-parallel, the attention's input gathered from the sequence split (a plain tensor with
    local_attention_input), wo row-wise back onto it, and a dense feed-forward's w1/w3 column-wise and w2 row-wise
    (a MoE feed-forward is its family's to split)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None),
                                        use_local_output=local_attention_input),
        **projections,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if dense_feed_forward:
        plan.update({
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard the model over tp_mesh (see the module docstring); works on pipeline stages with missing parts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    parallelize_root(model, tp_mesh, loss_parallel)

    for block in model.layers.values():
        if block is None:
            continue
        qk_norm = block.attention.q_norm is not None
        projections = {
            "attention.wq": ColwiseParallel(use_local_output=not qk_norm),
            "attention.wk": ColwiseParallel(use_local_output=not qk_norm),
            "attention.wv": ColwiseParallel(),
        }
        plan = block_tp_plan(projections, isinstance(block.feed_forward, FeedForward))
        if qk_norm:
            # q and k stay DTensors (sharded by head) up to their norms, which see the heads as a sharded "sequence"
            # dim: the weight is replicated and its gradient, partial on each rank, is summed by DTensor. The norms
            # hand on their rank's heads as plain tensors, as the column-parallel wv does, for RoPE and attention.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, float8_plan(block, plan))


def apply_context_parallel(model: nn.Module, cp_group: ProcessGroup, mode: str,
                           hybrid_groups: tuple[ProcessGroup, ProcessGroup] | None = None) -> None:
    """Every attention takes its chunks' positions and attends across the cp ranks (one context of parallel.cp_mode
    `mode` for all; hybrid_groups: hybrid's Ulysses and ring groups); a model that pools statistics over its tokens
    (a MoE model's load-balancing loss) takes the context too, to pool them over the cp ranks."""
    context = context_for(mode, cp_group, hybrid_groups)
    for block in model.layers.values():
        if block is not None:
            block.attention.context = context
    if hasattr(model, "context"):
        model.context = context


def parallelize_decoder(model: nn.Module, dims: ParallelDims, cfg: JobConfig,
                        tp_plan: Callable[[nn.Module, DeviceMesh, bool], None] = apply_tp) -> nn.Module:
    """Apply TP (tp_plan: this decoder's, or a family's own), context parallelism, activation checkpointing and
    offload, compile and data parallelism, in that order, to a model (or stage)."""
    if dims.tp_enabled:
        tp_plan(model, dims.tp_mesh, cfg.parallel.loss_parallel)
        place_adapters(model, dims.tp_mesh)  # LoRA's A and B cut as their linears (a no-op without adapters)
    if dims.cp_enabled:
        hybrid_groups = dims.hybrid_cp_groups() if cfg.parallel.cp_mode == "hybrid" else None
        apply_context_parallel(model, dims.cp_mesh.get_group(), cfg.parallel.cp_mode, hybrid_groups)
    if cfg.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpoint)
    apply_activation_offload(model, cfg.activation_checkpoint)  # the blocks not recomputed, when offload is on
    if cfg.compile.enable:
        if dims.tp_enabled and model.tok_embeddings is not None:
            # The embedding's local output is a view of a DTensor's storage; a compiled block taking that view as
            # input computes a wrong-typed gradient for it. A copy (B x S/tp x dim, once per step) avoids that.
            model.tok_embeddings.register_forward_hook(_fresh_output)
        apply_compile(model, cfg.compile, inside_checkpoint=dims.tp_enabled)
    if dims.dp_enabled:
        apply_data_parallel(model, dims, cfg)
    elif dims.tp_enabled:
        # FSDP / replicate bring each gradient into its parameter's TP placements; without them, hooks do (installed
        # by materialize on the real parameters).
        request_grads_in_param_layout(model)
    return model

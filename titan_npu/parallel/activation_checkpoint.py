"""Activation checkpointing applied from outside the model: none, full (every block) or selective.

selective checkpoints every Nth block (activation_checkpoint.selective_every), or, with selective_ops, wraps
every block in an op-level policy that keeps the outputs of matmuls and attention (expensive to recompute,
cheap to keep relative to their inputs) and recomputes the element-wise rest (norms, rotary, SwiGLU).
Wrapped blocks keep their state-dict names (the wrapper strips its prefix in state_dict / load_state_dict).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from titan_npu.config.schema import ActivationCheckpointConfig



def _save_list() -> set:
    """Ops whose outputs op-level selective checkpointing keeps."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    # A tensor-parallel block's reduce-scatter is communication: recomputing it would repeat it in backward.
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    # torch_npu's fused attention, when torch_npu is loaded.
    npu = getattr(torch.ops, "npu", None)
    for name in ("npu_fusion_attention",):
        op = getattr(npu, name, None) if npu is not None else None
        if op is not None:
            ops.add(op.default)
    return ops


def _op_level_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _save_list()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_block(block: nn.Module, op_level: bool = False) -> nn.Module:
    """Wrap one block so its activations are recomputed in backward (all of them, or all but the op-level saves)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # The blocks draw no random numbers (no dropout), so saving and restoring the RNG state would be wasted work.
    if op_level:
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_level_context)
    return checkpoint_wrapper(block, preserve_rng_state=False)


def blocks_to_checkpoint(layer_ids: list[str], cfg: ActivationCheckpointConfig) -> list[str]:
    """Ids of the blocks that mode / selective_every select (selective: blocks N-1, 2N-1, ... by global id)."""
    if cfg.mode == "none":
        return []
    if cfg.mode == "full" or cfg.selective_ops:
        return list(layer_ids)
    every = max(1, cfg.selective_every)
    return [i for i in layer_ids if (int(i) + 1) % every == 0]


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpointConfig) -> int:
    """Replace the selected blocks of model.layers by checkpointed ones; returns how many were wrapped."""
    present = [i for i, block in model.layers.items() if block is not None]
    chosen = blocks_to_checkpoint(present, cfg)
    op_level = cfg.mode == "selective" and cfg.selective_ops
    for layer_id in chosen:
        model.layers.register_module(layer_id, checkpoint_block(model.layers[layer_id], op_level=op_level))
    return len(chosen)

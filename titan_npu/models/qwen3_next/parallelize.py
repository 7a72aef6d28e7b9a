"""How a Qwen3-Next / Qwen3.5 model is parallelised: the MoE decoder's steps (models/moe_decoder/parallelize.py:
expert parallelism, the experts' tensor parallelism, activation checkpointing, compile per block, FSDP / HSDP and
pipeline stages as the decoder's), with this family's tensor-parallel plan for its blocks.

Tensor parallelism (parallel.tp_degree), with sequence parallelism as the decoder's:
  gated attention            wq (query and gate of whole heads) / wk / wv column-wise, q / k norms per local head,
                             wo row-wise: the decoder's plan
  gated DeltaNet             in_q/in_k/in_v/in_z/in_b/in_a column-wise (whole key heads and the value heads they serve),
                             conv_q/conv_k/conv_v, A_log, dt_bias split the same way (dim 0), the gated norm's weight
                             replicated (its gradient summed over the ranks), out row-wise
  MoE / dense feed-forward   as the MoE decoder's / the decoder's; the shared expert's gate replicated
Refused in one line (check_qwen3_next_layout): context parallelism (the gated delta rule's state would have to pass
from one cp rank's part of the sequence to the next: no cross-rank scan yet), and a tp_degree that does not divide the
linear layers' key heads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_npu.errors import LayoutError
from titan_npu.models.decoder.model import FeedForward
from titan_npu.models.decoder.parallelize import block_tp_plan, parallelize_decoder, parallelize_root
from titan_npu.models.moe.parallelize import apply_expert_parallel, apply_expert_tensor_parallel
from titan_npu.models.qwen3_next.args import Qwen3NextArgs
from titan_npu.models.qwen3_next.model import GatedDeltaNet
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.float8 import float8_plan

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig

# A linear layer's own parameters split by head under tensor parallelism (dim 0).
SPLIT_BY_HEAD = ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")


def check_qwen3_next_layout(dims: ParallelDims, args: Qwen3NextArgs, cfg: JobConfig) -> None:
    """The layouts above refused (LayoutError): parallelize_qwen3_next's first step, and what the planner's search
    skips (ModelSpec.check_layout)."""
    if dims.cp_enabled:
        raise LayoutError(f"parallel.cp_degree={dims.cp}: Qwen3-Next's linear-attention layers have no context-"
                          f"parallel scan (their recurrent state does not pass between cp ranks); set "
                          f"parallel.cp_degree = 1")
    if dims.tp_enabled and args.n_linear_layers and args.linear_n_k_heads % dims.tp:
        raise LayoutError(f"parallel.tp_degree={dims.tp} does not divide model.linear_n_k_heads="
                          f"{args.linear_n_k_heads}: each rank takes whole key heads of the linear layers")


def split_linear_parameters(mixer: GatedDeltaNet, tp_mesh: DeviceMesh) -> None:
    """A linear layer's convolution and decay parameters split by head over tp_mesh, its gated norm's weight
    replicated (before data parallelism)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for name in (*SPLIT_BY_HEAD, "norm_weight"):
        param = getattr(mixer, name)
        if name == "norm_weight":
            value = DTensor.from_local(param.detach(), tp_mesh, [Replicate()], run_check=False)
        else:
            local = param.detach().chunk(tp)[rank].contiguous()
            value = DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                       stride=param.stride())
        setattr(mixer, name, nn.Parameter(value, requires_grad=param.requires_grad))
    mixer.tp_group = tp_mesh.get_group()


def apply_hybrid_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """The tensor-parallel plan above on every block this model (or stage) holds, and the decoder's on its root."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_root(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        if block is None:
            continue
        dense = isinstance(block.feed_forward, FeedForward)
        if isinstance(block.attention, GatedDeltaNet):
            split_linear_parameters(block.attention, tp_mesh)
            plan = block_tp_plan({f"attention.in_{x}": ColwiseParallel() for x in "qkvzba"}, dense,
                                 local_attention_input=True)
            del plan["attention.wo"]
            plan["attention.out"] = RowwiseParallel(output_layouts=Shard(1))
        else:
            plan = block_tp_plan({"attention.wq": ColwiseParallel(use_local_output=False),
                                  "attention.wk": ColwiseParallel(use_local_output=False),
                                  "attention.wv": ColwiseParallel()}, dense)
            # q and k stay DTensors sharded by head up to their norms (the decoder's Qwen3 plan).
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, float8_plan(block, plan))


def parallelize_qwen3_next(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Expert and MoE tensor parallelism, then this family's TP plan, activation checkpointing, compile and data
    parallelism (the MoE decoder's order), after refusing the layouts above."""
    check_qwen3_next_layout(dims, model.args, cfg)
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.ep_mesh, dims.ep_tp_mesh if dims.tp_enabled else None)
    if dims.tp_enabled:
        apply_expert_tensor_parallel(model, dims.tp_mesh)
        model.sequence_shards = dims.tp
    return parallelize_decoder(model, dims, cfg, tp_plan=apply_hybrid_tp)

"""How a gpt-oss model is parallelised: the MoE decoder's steps (models/moe_decoder/parallelize.py: expert parallelism,
the experts' tensor parallelism, then the dense decoder's TP plan, activation checkpointing, compile per block and
data parallelism), with the attention sinks split by head under tensor parallelism first.

Tensor parallelism (parallel.tp_degree), with sequence parallelism as the decoder's:
  attention.wq/wk/wv and their biases   column-wise (whole heads per rank); attention.sinks split the same way
  attention.wo and its bias             row-wise (the bias added once, after the sum), reduce-scattered
  MoE router (weight, bias)             replicated: every rank routes the gathered sequence
  experts w1/w3, b1/b3 | w2 | b2        split on the ffn dim | on its input | replicated, each rank adding 1 / tp
Refused in one line: context parallelism (the ring / Ulysses attention takes no sink or window) and tensor with
expert parallelism together."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_npu.errors import LayoutError
from titan_npu.models.gpt_oss.args import GptOssArgs
from titan_npu.models.moe_decoder.parallelize import parallelize_moe
from titan_npu.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def check_gpt_oss_layout(dims: ParallelDims, args: GptOssArgs, cfg: JobConfig) -> None:
    """The layouts above refused (LayoutError): parallelize_gpt_oss's first step, and what the planner's search
    skips (ModelSpec.check_layout)."""
    if dims.cp_enabled:
        raise LayoutError(f"parallel.cp_degree={dims.cp}: context-parallel attention takes no attention sink or "
                          f"sliding window (gpt-oss); set parallel.cp_degree = 1")
    if dims.tp_enabled and dims.ep_enabled:
        raise LayoutError(f"parallel.tp_degree={dims.tp} with parallel.ep_degree={dims.ep}: gpt-oss's expert biases "
                          f"are not split over both yet; set parallel.ep_degree = 1 or parallel.tp_degree = 1")


def shard_sinks(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Each attention's sinks [n_heads] split by head over tp_mesh, as its q heads are (before data parallelism)."""
    from torch.distributed.tensor import DTensor, Shard

    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    for block in model.layers.values():
        if block is None:
            continue
        sinks = block.attention.sinks
        local = sinks.detach().chunk(tp)[rank].contiguous()
        sharded = DTensor.from_local(local, tp_mesh, [Shard(0)], run_check=False, shape=sinks.shape,
                                     stride=sinks.stride())
        block.attention.sinks = nn.Parameter(sharded, requires_grad=sinks.requires_grad)


def parallelize_gpt_oss(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """The sinks split by head (tensor parallel), then the MoE decoder's parallelisation; the layouts above refused
    (check_gpt_oss_layout)."""
    check_gpt_oss_layout(dims, model.args, cfg)
    if dims.tp_enabled:
        shard_sinks(model, dims.tp_mesh)
    return parallelize_moe(model, dims, cfg)

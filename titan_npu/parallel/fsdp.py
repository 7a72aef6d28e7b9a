"""Data parallelism on FSDP2: fully_shard (FSDP / HSDP) or replicate (plain DP), per transformer block and the root.

Both keep parameter names unchanged and use the same mixed-precision policy: parameters and compute in the
training dtype, gradients reduced in fp32. Reductions are plain SUM / AVG, which every backend (gloo included)
runs; no custom divide factor (PREMUL_SUM) is ever set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_npu.device.dtypes import to_torch_dtype
from titan_npu.parallel import arithmetic
from titan_npu.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def mixed_precision_policy(dtype_name: str, cast_forward_inputs: bool = True):
    """Parameters (and so compute) in the training dtype; gradient reduction always in fp32.

    cast_forward_inputs=False for the transformer blocks: they take the fp32 RoPE tables as inputs, which must
    reach the rotation unrounded (as on one device); their hidden-state input is already in the training dtype,
    produced by the root's embedding (or cast by the root of a pipeline stage that receives it).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=to_torch_dtype(dtype_name), reduce_dtype=torch.float32,
                                cast_forward_inputs=cast_forward_inputs)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [block for block in model.layers.values() if block is not None]


def apply_fsdp(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """fully_shard each transformer block and the root over dp_shard (or dp_replicate x dp_shard for HSDP)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = {"mesh": dims.dp_mesh}
    if cfg.parallel.cpu_offload:
        # Pinned host memory needs an accelerator; on a cpu-only run the parameters are host memory already.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    reshard_after_forward = arithmetic.reshards_after_forward(cfg.parallel.reshard_after_forward, dims.pp,
                                                              cfg.parallel.pp_schedule)
    blocks = _blocks(model)
    block_policy = mixed_precision_policy(cfg.training.dtype, cast_forward_inputs=False)
    if dims.ep_enabled:
        _shard_experts(model, dims, kwargs, block_policy, reshard_after_forward)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keeping them gathered saves an
        # all-gather per step at no extra peak memory.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, mp_policy=block_policy, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward,
                mp_policy=mixed_precision_policy(cfg.training.dtype), **kwargs)


def _shard_experts(model: nn.Module, dims: ParallelDims, kwargs: dict, policy, reshard_after_forward: bool) -> None:
    """Expert-parallel experts (DTensors over the ep ranks already, one slice of the experts per rank): where no two
    ranks hold the same experts FSDP leaves them (kwargs gets them as ignored_params); otherwise each module holding
    them is sharded by FSDP over the ranks that hold the same experts (ParallelDims.expert_dp_mesh)."""
    from torch.distributed.fsdp import fully_shard

    # The ep mesh's dim: "ep", or the dp_shard (dp_shard_cp under context parallelism) ranks it borrows whole.
    ep_dims = set(dims.ep_mesh.mesh_dim_names)

    def is_expert(p: nn.Parameter) -> bool:  # a DTensor over the ep ranks (tensor-parallel DTensors are over tp only)
        mesh = getattr(p, "device_mesh", None)
        return mesh is not None and bool(ep_dims & set(mesh.mesh_dim_names))

    if dims.expert_dp_mesh is None:
        kwargs["ignored_params"] = {p for p in model.parameters() if is_expert(p)}
        return
    for module in list(model.modules()):
        if any(is_expert(p) for p in module.parameters(recurse=False)):
            fully_shard(module, **{**kwargs, "mesh": dims.expert_dp_mesh},
                        reshard_after_forward=reshard_after_forward, mp_policy=policy)


def apply_replicate(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """Plain data parallelism (fsdp = false): full parameters on every rank, gradients all-reduced per block."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in _blocks(model):
        replicate(block, mesh=dims.dp_mesh, mp_policy=mixed_precision_policy(cfg.training.dtype, False))
    replicate(model, mesh=dims.dp_mesh, mp_policy=mixed_precision_policy(cfg.training.dtype))


def apply_data_parallel(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """FSDP, HSDP or replicate as the layout says; nothing when there is one data-parallel rank."""
    mode = dims.dp_mode
    if mode in ("fsdp", "hsdp"):
        apply_fsdp(model, dims, cfg)
    elif mode == "replicate":
        apply_replicate(model, dims, cfg)

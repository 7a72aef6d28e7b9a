"""How a DeepSeek-V3.2 model is parallelised: as DeepSeek-V3 (models/deepseek_v3/parallelize.py: FSDP / HSDP,
expert parallelism, activation checkpointing, pipeline stages), with what DeepSeek Sparse Attention cannot take yet
refused in one line (ModelSpec.check_layout):
  context parallelism   each query's top-k runs over the whole sequence, which the cp ranks split
  tensor parallelism    the indexer and the selected-key attention have no tensor-parallel plan
  pipeline parallelism  while the indexers learn: their KL losses are summed in the model, which a stage holds in
                        part (indexer_loss_weight = 0 pipelines as DeepSeek-V3 does); and with layers that reuse
                        another layer's selection (model.indexer_types), which may lie on another stage
  index_topk >= training.seq_len in the sparse stage: every query would keep every key it sees, so the "sparse"
                        stage would train dense attention; the dense warm-up, or a top-k below the sequence length,
                        says what is meant (evaluation and import follow the published top-min(index_topk, S))."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titan_npu.errors import LayoutError
from titan_npu.models.deepseek_v3.parallelize import check_deepseek_layout, parallelize_deepseek
from titan_npu.models.deepseek_v32.args import SPARSE, DSAArgs
from titan_npu.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def check_dsa_layout(dims: ParallelDims, args: DSAArgs, cfg: JobConfig) -> None:
    """The layouts and settings above refused (LayoutError), then DeepSeek-V3's."""
    if dims.cp_enabled:
        raise LayoutError(f"parallel.cp_degree={dims.cp} with DeepSeek Sparse Attention: the indexer's top-k runs over "
                          f"the whole sequence, which context parallelism splits; set parallel.cp_degree = 1")
    if dims.tp_enabled:
        raise LayoutError(f"parallel.tp_degree={dims.tp} with DeepSeek Sparse Attention: the lightning indexer has no "
                          f"tensor-parallel plan yet; set parallel.tp_degree = 1 (FSDP, ep and pp shard it)")
    if dims.pp_enabled and args.n_indexers < args.n_layers:
        raise LayoutError(f"parallel.pp_degree={dims.pp} with model.indexer_types sharing selections across layers: "
                          f"a stage could start with a layer whose indexer is on another stage; set "
                          f"parallel.pp_degree = 1")
    if dims.pp_enabled and args.trains_indexer:
        raise LayoutError(f"parallel.pp_degree={dims.pp} with model.indexer_loss_weight={args.indexer_loss_weight}: "
                          f"the indexers' KL losses are not carried across pipeline stages; set "
                          f"model.indexer_loss_weight = 0 (indexers frozen) or parallel.pp_degree = 1")
    seq_len = cfg.training.seq_len
    if args.dsa_stage == SPARSE and args.index_topk >= seq_len:
        raise LayoutError(f"model.index_topk={args.index_topk} >= training.seq_len={seq_len} in the sparse stage: "
                          f"every query would keep all its keys (dense attention); lower model.index_topk below "
                          f"{seq_len}, raise training.seq_len, or set model.dsa_stage = \"dense_warmup\"")
    check_deepseek_layout(dims, args, cfg)


def parallelize_dsa(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """check_dsa_layout; each indexer its own data-parallel unit; then DeepSeek-V3's parallelisation."""
    check_dsa_layout(dims, model.args, cfg)
    if dims.dp_enabled:
        _indexers_as_units(model, dims, cfg)
    return parallelize_deepseek(model, dims, cfg)


def _indexers_as_units(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> None:
    """fully_shard (or replicate) each lightning indexer on its own, before its block is. The indexer's input is
    detached, so its backward (its KL loss's) is not inside the block's: as part of the block's unit its sharded
    weights would be freed by then (the dense warm-up fails outright) and its gradients could miss the block's
    reduction. As a unit of its own it is gathered for its backward by its output's hook and reduced after it."""
    from torch.distributed.fsdp import fully_shard

    from titan_npu.parallel.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(cfg.training.dtype, cast_forward_inputs=False)
    for block in model.layers.values():
        indexer = None if block is None else block.attention.indexer
        if indexer is None:
            continue
        if dims.dp_mode == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(indexer, mesh=dims.dp_mesh, mp_policy=policy)
        else:
            fully_shard(indexer, mesh=dims.dp_mesh, reshard_after_forward=cfg.parallel.reshard_after_forward,
                        mp_policy=policy)

"""How a DeepSeek-V3 model is parallelised: as the dense decoder (parallelize_decoder: activation checkpointing,
compile per block, FSDP / HSDP / replicate), pipeline stages split as the decoder's; under expert parallelism
(parallel.ep_degree) the experts are split over the ep ranks first (models/moe/parallelize.py). Tensor and context
parallelism of multi-head latent attention are not in this version, nor balancing (score bias updates, the
sequence-wise loss) under pipeline parallelism: a run asking for them is refused in one line."""

from __future__ import annotations

from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.errors import LayoutError
from titan_npu.models.decoder.parallelize import parallelize_decoder
from titan_npu.models.moe.parallelize import apply_expert_parallel
from titan_npu.parallel.dims import ParallelDims


def parallelize_deepseek(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Expert parallelism, then activation checkpointing, compile and data parallelism as for the dense decoder;
    TP and CP refused."""
    for enabled, key, degree in ((dims.tp_enabled, "tp_degree", dims.tp), (dims.cp_enabled, "cp_degree", dims.cp)):
        if enabled:
            raise LayoutError(f"parallel.{key}={degree}: {key[:2].upper()} of multi-head latent attention "
                              f"({cfg.model.name}) is not supported yet; set parallel.{key} = 1 and shard with FSDP "
                              f"(parallel.dp_shard) and expert parallelism (parallel.ep_degree)")
    args = model.args
    if dims.pp_enabled and (args.score_bias_rate > 0 or args.seq_aux_loss_coef > 0):
        raise LayoutError(f"parallel.pp_degree={dims.pp} with model.score_bias_rate={args.score_bias_rate} / "
                          f"model.seq_aux_loss_coef={args.seq_aux_loss_coef}: balancing across pipeline stages is not "
                          f"supported yet; set both to 0 or parallel.pp_degree = 1")
    if args.mtp_depth and (dims.pp_enabled or cfg.training.loss_chunk_tokens == 0):
        raise LayoutError(f"model.mtp_depth={args.mtp_depth} needs the loss inside the model's forward: set "
                          f"parallel.pp_degree = 1 (now {dims.pp}) and training.loss_chunk_tokens > 0 (now "
                          f"{cfg.training.loss_chunk_tokens})")
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.ep_mesh)
    return parallelize_decoder(model, dims, cfg)

"""How a DeepSeek-V3 model is parallelised: tensor parallelism (below), then expert parallelism
(parallel.ep_degree: the experts split over the ep ranks, models/moe/parallelize.py), then activation
checkpointing, compile per block and data parallelism (FSDP / HSDP / replicate) as for the dense decoder; pipeline
stages split as the decoder's (the dense layers first).

Tensor parallelism (parallel.tp_degree), with sequence parallelism as the decoder's:
  tok_embeddings, norm, output, attention_norm, ffn_norm   as the dense decoder
  attention.wq / wq_b, attention.wkv_b                     column-wise: each rank holds whole heads
  attention.wo                                             row-wise, reduce-scattered back onto the sequence
  attention.wq_a, q_norm, wkv_a, kv_norm                   replicated (the low-rank down-projections and their
                                                           norms, and the RoPE key shared by every head): every
                                                           rank computes them on the whole sequence; their
                                                           gradients arrive summed over the ranks (through the
                                                           column-wise inputs, and an explicit sum for the key)
  dense feed_forward (the first_k_dense layers)            as the decoder's (w1/w3 column-wise, w2 row-wise)
  MoE feed_forward (router, experts, shared experts)       replicated: every rank routes and runs the whole
                                                           sequence (gathered), then keeps its own slice
Context parallelism (parallel.cp_degree, any parallel.cp_mode) as the decoder's: MLA's q, k (the shared RoPE key
expanded per head) and zero-padded v go through the same context seam, RoPE at the chunks' true positions.
Refused in one line: multi-token prediction under context parallelism, tensor parallelism with the sequence-wise
balance loss (and with expert parallelism: parallel/layout.py), the sequence-wise balance loss under pipeline
parallelism (the score bias moves there: each stage from its own layers' load), multi-token prediction without
the loss in the forward (pipeline or tensor parallelism, training.loss_chunk_tokens = 0) and multi-token prediction
with document masking (data.document_mask)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_npu.errors import LayoutError
from titan_npu.models.decoder.parallelize import block_tp_plan, parallelize_decoder, parallelize_root
from titan_npu.models.deepseek_v3.args import DeepSeekArgs
from titan_npu.models.moe.parallelize import apply_expert_parallel
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.float8 import float8_plan

if TYPE_CHECKING:
    from titan_npu.config.schema import JobConfig


def check_deepseek_layout(dims: ParallelDims, args: DeepSeekArgs, cfg: JobConfig) -> None:
    """The layouts above refused (LayoutError), beyond parallel/layout.py's: parallelize_deepseek's first step, and
    what the planner's search skips (ModelSpec.check_layout)."""
    if dims.cp_enabled and args.mtp_depth:
        raise LayoutError(f"parallel.cp_degree={dims.cp} with model.mtp_depth={args.mtp_depth}: multi-token prediction "
                          f"shifts whole sequences, which context parallelism splits; set one of them to 0 / 1")
    if args.mtp_depth and cfg.data.document_mask:
        raise LayoutError(f"model.mtp_depth={args.mtp_depth} with data.document_mask = true: the multi-token "
                          f"prediction modules do not take the document mask yet; set model.mtp_depth = 0 or "
                          f"data.document_mask = false")
    if dims.tp_enabled and args.seq_aux_loss_coef > 0:
        raise LayoutError(f"parallel.tp_degree={dims.tp} with model.seq_aux_loss_coef={args.seq_aux_loss_coef}: the "
                          f"sequence-wise balance loss under tensor parallelism is not supported yet; set "
                          f"model.seq_aux_loss_coef = 0 (the score bias balances) or parallel.tp_degree = 1")
    if dims.pp_enabled and args.seq_aux_loss_coef > 0:
        raise LayoutError(f"parallel.pp_degree={dims.pp} with model.seq_aux_loss_coef={args.seq_aux_loss_coef}: the "
                          f"sequence-wise balance loss across pipeline stages is not supported yet; set "
                          f"model.seq_aux_loss_coef = 0 (the score bias balances) or parallel.pp_degree = 1")
    if args.mtp_depth and not dims.loss_chunk_tokens(cfg.training.loss_chunk_tokens):  # the loss off the forward
        raise LayoutError(f"model.mtp_depth={args.mtp_depth} needs the loss inside the model's forward: set "
                          f"parallel.pp_degree = 1 (now {dims.pp}), parallel.tp_degree = 1 (now {dims.tp}) and "
                          f"training.loss_chunk_tokens > 0 (now {cfg.training.loss_chunk_tokens})")
    if dims.tp_enabled and dims.ep_enabled:
        raise LayoutError(f"parallel.tp_degree={dims.tp} with parallel.ep_degree={dims.ep}: the MoE layers are "
                          f"replicated over the tp ranks, which expert parallelism cannot split yet; set "
                          f"parallel.ep_degree = 1 or parallel.tp_degree = 1")


def parallelize_deepseek(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Expert parallelism, then the dense decoder's steps with this family's TP plan (context parallelism through
    the decoder's seam, activation checkpointing, compile, data parallelism); the layouts above refused
    (check_deepseek_layout)."""
    check_deepseek_layout(dims, model.args, cfg)
    if dims.ep_enabled:  # never with TP (refused above), so before or after the TP plan is the same
        apply_expert_parallel(model, dims.ep_mesh)
    return parallelize_decoder(model, dims, cfg, tp_plan=apply_tp)


def _gather_sequence(mesh: DeviceMesh):
    """A forward pre-hook: the module's input, this rank's slice of the sequence, becomes the whole sequence (its
    gradient is cut back to the slice)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return (x.redistribute(mesh, [Replicate()]).to_local(), *args[1:])
    return hook


def _keep_own_slice(mesh: DeviceMesh):
    """A forward hook: of the module's output (the whole sequence, the same on every rank) this rank keeps its
    slice; the gradient is gathered back to the whole sequence."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module: nn.Module, args: tuple, output):
        out, *rest = output
        out = DTensor.from_local(out, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (out.to_local(), *rest)
    return hook


def _replicate(module: nn.Module, mesh: DeviceMesh, hooks: bool = True) -> None:
    """Hold the module's own parameters as DTensors replicated over the mesh (one optimizer, one checkpoint layout
    with the sharded ones); with hooks, it takes and returns plain tensors (the same on every rank) around them."""
    from torch.distributed.tensor import DTensor, Replicate

    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False),
                                           requires_grad=param.requires_grad))
    if hooks:
        module.register_forward_pre_hook(
            lambda m, args: (DTensor.from_local(args[0], mesh, [Replicate()], run_check=False), *args[1:]))
        module.register_forward_hook(lambda m, args, out: out.to_local())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard the model over tp_mesh (the module docstring's plan); works on pipeline stages with missing parts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_root(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        if block is None:
            continue
        attention = block.attention
        projections = {"attention.wq_b" if hasattr(attention, "wq_b") else "attention.wq": ColwiseParallel(),
                       "attention.wkv_b": ColwiseParallel()}
        # The whole sequence as a plain tensor: the replicated low-rank path computes on it.
        plan = block_tp_plan(projections, not block.is_moe, local_attention_input=True)
        parallelize_module(block, tp_mesh, float8_plan(block, plan))
        attention.tp_group = tp_mesh.get_group()
        for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
            if hasattr(attention, name):
                _replicate(getattr(attention, name), tp_mesh)
        if block.is_moe:
            moe = block.feed_forward
            moe.register_forward_pre_hook(_gather_sequence(tp_mesh))
            moe.register_forward_hook(_keep_own_slice(tp_mesh))
            _replicate(moe.router.gate, tp_mesh, hooks=False)  # the router reads its weight's local tensor
            _replicate(moe.experts, tp_mesh, hooks=False)  # so do the grouped experts
            if moe.shared_experts is not None:
                for linear in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
                    _replicate(linear, tp_mesh)

"""Dry run: build one rank of an N-rank job for real, without devices, and report what that rank would hold.

The model is built on the meta device and parallelized by the project's own parallelize/pipeline code over a fake
process group (torch's FakeStore + "fake" backend: collectives return at once, nothing is sent), so every mesh,
DTensor placement and FSDP shard is the one the job would create. Parameters are then made fake tensors (shapes
without storage) to run one forward and backward, which checks every shape end to end, and the optimizer is built
over the sharded parameters. Byte counts come from the local shards of the resulting DTensors.

Under expert parallelism the token exchange's split sizes are routed counts, values fake tensors do not hold: the
dry run assumes balanced routing (every expert gets an equal share of the routed copies from each rank), the
assumption the planner's activation and all-to-all estimates make too, and runs the exchange with those sizes (the
family's ModelSpec.balanced_routing).
Under context parallelism each rank runs its seq_len / cp tokens of every sequence, as the trainer does.

    python train.py --config configs/llama3_70b.toml --dry-run --world-size 64 --rank 5
    titan-npu plan --config configs/llama3_70b.toml --nodes 8 --devices-per-node 8 --verify --rank 5

planner/verify.py compares what it measures (planner/dry_run_result.py) with the planner's exact numbers.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError, DeviceError, LayoutError
from titan_npu.lora.apply import lora_adapter
from titan_npu.planner.dry_run_result import DryRunResult
from titan_npu.planner.verify import compare_with_plan
from titan_npu.trainer.optimizer import clean_name

if TYPE_CHECKING:
    from titan_npu.parallel.dims import ParallelDims

MAX_DRY_RUN_WORLD = 65_536  # ranks: a dry run of this many takes seconds, its mesh grows with the world


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _placements(t: torch.Tensor) -> list[str]:
    return [str(p) for p in getattr(t, "placements", ())]


def optimizer_state_bytes_per_param_byte(cfg: JobConfig, muon: bool = False) -> float:
    """State bytes the configured optimizer keeps per parameter byte, measured on a real 2x3 parameter (under
    optimizer.name = Muon: one Muon takes (`muon`), or one it leaves to AdamW).

    Optimizer states of meta/fake parameters are not created until a step (and stepping a 70B fake model costs
    more than the whole dry run), so the per-parameter ratio is taken from the same optimizer on a tiny tensor:
    every state tensor shaped like its parameter counts (scalar step counters do not scale and are left out).
    """
    from titan_npu.trainer.optimizer import build_optimizer

    holder = nn.Module()
    holder.weight = nn.Parameter(torch.zeros(2, 3))
    optimizer_cfg = replace(cfg.optimizer, muon_exclude=[] if muon else ["*"])
    optimizer = build_optimizer([holder], optimizer_cfg, "cpu")
    holder.weight.grad = torch.ones_like(holder.weight)
    optimizer.step()
    state = optimizer.state[holder.weight]
    per_param = sum(v.numel() * v.element_size() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.shape == holder.weight.shape)
    return per_param / (holder.weight.numel() * holder.weight.element_size())


def resolve_world_size(cfg: JobConfig, world_size: int | None) -> int:
    """The dry run's world size: given, else the product of the config's degrees when none is -1; at most
    MAX_DRY_RUN_WORLD (its device mesh, built in this process, grows with the world)."""
    if world_size is not None:
        if world_size < 1:
            raise ConfigError(f"--world-size {world_size} must be >= 1")
    else:
        p = cfg.parallel
        if p.dp_shard == -1:
            raise ConfigError("a dry run needs the job's size: pass --world-size N (parallel.dp_shard = -1 means "
                              "'all remaining ranks', so the config alone does not say how many)")
        world_size = p.dp_replicate * p.dp_shard * p.tp_degree * p.pp_degree
    if world_size > MAX_DRY_RUN_WORLD:
        raise ConfigError(f"a dry run of {world_size:,} ranks: it builds jobs of at most {MAX_DRY_RUN_WORLD:,} ranks "
                          f"(the device mesh is built in this process); dry-run a smaller job with the same tp, pp "
                          f"and cp degrees, or plan this one without --verify / --dry-run")
    return world_size


def build_parallel_model(cfg: JobConfig, dims: ParallelDims) -> list[nn.Module]:
    """The model parts this rank holds, on meta: pipeline split, then each part parallelized as the trainer does."""
    from titan_npu.models.registry import build_model_args, spec_of
    from titan_npu.parallel.parallelize import parallelize_part
    from titan_npu.parallel.pipeline import split_for_pipeline

    args = build_model_args(cfg.model)
    spec = spec_of(args)
    with torch.device("meta"):
        model = spec.build_model(args)
    adapt = lora_adapter(cfg.lora)
    if adapt is not None:  # LoRA: the frozen model with its adapters, as the trainer builds it
        adapt(model)
    _, parts = split_for_pipeline(spec, model, dims, cfg) if dims.pp_enabled else ([0], [model])
    return [parallelize_part(spec, part, dims, cfg) for part in parts]


def _forward_backward(cfg: JobConfig, parts: list[nn.Module], dims: ParallelDims) -> tuple[int, ...]:
    """One forward/backward of every part with fake tensors (the loss: cross entropy, or a stand-in on a stage
    without the output, plus the part's auxiliary_loss()); returns the output shape of the last part run.

    A pipeline stage without the embedding takes the hidden states its predecessor would send (a MoE model's routing
    sums, which the trainer's stages carry on too, it runs without: its own layers' are what it holds): the local
    [micro-batch, seq / tp (sequence parallel), dim] slice, in the dtype the activations have. A context-parallel
    rank takes its seq / cp tokens of each sequence.
    """
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_npu.device.dtypes import to_torch_dtype
    from titan_npu.models.registry import build_model_args, spec_of
    from titan_npu.parallel.layout import pp_local_batch, pp_microbatches
    from titan_npu.parallel.tp_grads import install_requested_grad_hooks

    args = build_model_args(cfg.model)
    t = cfg.training
    batch = pp_local_batch(cfg) // pp_microbatches(cfg, dims) if dims.pp_enabled else t.batch_size
    hidden_dtype = to_torch_dtype(t.dtype) if dims.dp > 1 else torch.float32
    seq = t.seq_len // dims.cp
    seq_local = seq // dims.tp
    shape: tuple[int, ...] = ()
    with FakeTensorMode(allow_non_fake_inputs=True), spec_of(args).balanced_routing(parts):
        for part in parts:
            # Fake storage on the host: FSDP refuses to run with meta parameters, and fake tensors cost nothing.
            part.to_empty(device="cpu")
            # to_empty gives each module a parameter of its own: re-tie a tied output, as init_weights does.
            part.tie_weights()
            # As materialize does: pure tensor parallelism's gradient layout hooks go on the real parameters.
            install_requested_grad_hooks(part)
        for part in parts:
            if part.tok_embeddings is not None:
                x = torch.randint(0, args.vocab_size, (batch, seq))
            else:
                x = torch.randn(batch, seq_local, args.dim, dtype=hidden_dtype, requires_grad=True)
            out = part(x)
            # A MoE model's stage but the last also sends its routing sums on (hidden states, counts, prob sums).
            out, *sent = out if isinstance(out, tuple) else (out,)
            shape = tuple(out.shape)
            if part.output is not None:
                logits = out.full_tensor() if hasattr(out, "full_tensor") else out
                labels = torch.randint(0, args.vocab_size, (batch, seq))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            else:
                # A stage that sends hidden states on: a stand-in loss reaches every parameter it holds.
                local = out.to_local() if hasattr(out, "to_local") else out
                loss = local.float().sum() + sum(t.float().sum() for t in sent if t.requires_grad)
            # The model's auxiliary terms, as the trainer adds them: they reach what the cross entropy does not (a
            # lightning indexer, whose input is detached, learns by its own loss alone).
            aux = part.auxiliary_loss() if hasattr(part, "auxiliary_loss") else None
            loss = loss if aux is None else loss + _local(aux).float().sum()
            if loss.requires_grad:  # nothing to differentiate when every parameter of the part is frozen
                loss.backward()
    return shape


def _build_and_measure(cfg: JobConfig, dims: ParallelDims, result: DryRunResult, device_type: str,
                       forward: bool) -> None:
    """Build this rank's parallelized model and optimizer, run forward/backward, and fill in `result`."""
    from titan_npu.trainer.optimizer import build_optimizer

    if dims.world_size > 1:
        dims.build_mesh("cpu")
    parts = build_parallel_model(cfg, dims)
    optimizer = build_optimizer(parts, cfg.optimizer, device_type)
    result.optimizer = type(optimizer).__name__
    muon = {id(p) for group in optimizer.param_groups if group.get("muon") for p in group["params"]}
    muon_bytes = trained_bytes = 0
    for part in parts:
        for raw_name, p in part.named_parameters():
            name = clean_name(raw_name)
            local = _local(p)
            result.parameters[name] = {
                "shape": list(p.shape), "local_shape": list(local.shape), "dtype": str(local.dtype).replace(
                    "torch.", ""), "placements": _placements(p),
            }
            result.parameter_bytes += local.numel() * local.element_size()
            if p.requires_grad:  # all but frozen weights (LoRA's base, a family's training stage)
                trained_bytes += local.numel() * local.element_size()
            if id(p) in muon:
                muon_bytes += local.numel() * local.element_size()
                # Orthogonalised whole: the shards of the last two dims are gathered, leading (expert) dims kept.
                gathered = math.prod(local.shape[:-2]) * p.shape[-2] * p.shape[-1]
                result.optimizer_gather_bytes += (gathered - local.numel()) * local.element_size()
    if forward:
        result.output_shape = _forward_backward(cfg, parts, dims)
        result.forward_checked = True
        for part in parts:
            for raw_name, p in part.named_parameters():
                name = clean_name(raw_name)
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    raise LayoutError(f"dry run: parameter {name} received no gradient on rank {result.rank}; "
                                      "the parallelized model does not reach it (a bug in the layout)")
                g = _local(p.grad)
                result.parameters[name]["grad_local_shape"] = list(g.shape)
                result.parameters[name]["grad_placements"] = _placements(p.grad)
                result.gradient_bytes += g.numel() * g.element_size()
    else:
        # Gradients take their parameter's shard shape and dtype (FSDP keeps sharded fp32 gradients).
        result.gradient_bytes = trained_bytes
    result.optimizer_bytes = int((trained_bytes - muon_bytes) * optimizer_state_bytes_per_param_byte(cfg)
                                 + muon_bytes * optimizer_state_bytes_per_param_byte(cfg, muon=True))


_ONE_AT_A_TIME = threading.Lock()


def dry_run(cfg: JobConfig, world_size: int | None = None, rank: int = 0, device_type: str = "npu",
            forward: bool = True) -> DryRunResult:
    """Build `rank` of a `world_size`-rank job on meta with a fake process group and measure what it holds.

    The work runs in a thread of its own: DTensor's sharding cache and DeviceMesh's registry are thread-local and
    keyed by mesh shape, not by rank or process group, so a thread that ends with the dry run takes them along and
    dry runs of other ranks or layouts (in the same process, one after another) start clean.
    """
    from titan_npu.models.registry import build_model_args
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.layout import validate_layout
    world_size = resolve_world_size(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank} is outside a {world_size}-rank job (choose 0..{world_size - 1})")
    if dist.is_initialized():
        raise DeviceError("a dry run sets up its own fake process group; run it as a plain process, not under "
                          "torchrun")
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    validate_layout(dims, build_model_args(cfg.model), cfg)
    uncompiled = cfg.compile.enable
    if uncompiled:
        # Compiled blocks run on fake tensors crash the process (segfault); compiling wraps the blocks but changes
        # no parameter, shard or placement, so the uncompiled model measures the same.
        cfg = replace(cfg, compile=replace(cfg.compile, enable=False))
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["result"] = _dry_run_in_this_thread(cfg, dims, world_size, rank, device_type, forward)
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    with _ONE_AT_A_TIME:  # the fake process group is the process's default group: one dry run at a time
        thread = threading.Thread(target=work, name=f"titan-dry-run-rank{rank}")
        thread.start()
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    outcome["result"].uncompiled = uncompiled
    return outcome["result"]


def _dry_run_in_this_thread(cfg: JobConfig, dims: ParallelDims, world_size: int, rank: int, device_type: str,
                            forward: bool) -> DryRunResult:
    """The dry run proper: fake process group up, build and measure, everything torn down again."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_npu.planner.layout import layout_from_config

    layout = layout_from_config(cfg, world_size)
    t0 = time.perf_counter()
    result = DryRunResult(world_size, rank, layout.describe(), layout.rank_coordinates(rank))
    # Fake tensors' dispatch cache is process-wide; entries of another rank's shards must not be reused.
    FakeTensorMode.cache_clear()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings():
            # torch warns that a cpu mesh lacks DTensor's RNG tracking and the like: true, and moot without data.
            warnings.simplefilter("ignore", UserWarning)
            _build_and_measure(cfg, dims, result, device_type, forward)
    finally:
        dist.destroy_process_group()
        FakeTensorMode.cache_clear()
        _clear_redistribute_cache()
    result.seconds = time.perf_counter() - t0
    return result


def _clear_redistribute_cache() -> None:
    """DTensor's redistribution planners are cached process-wide by mesh; drop those of the fake mesh."""
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:  # older torch: no such cache
        return
    clear_redistribute_planner_cache()


def run(cfg: JobConfig, world_size: int | None, rank: int, device_type: str = "npu", forward: bool = True,
        as_json: bool = False) -> int:
    """`train.py --dry-run`: run the dry run, print it with the planner's comparison; 0 when they agree."""
    import json

    result = dry_run(cfg, world_size, rank, device_type, forward)
    comparison = compare_with_plan(result, cfg)
    if as_json:
        print(json.dumps({"dry_run": result.as_dict(), "comparison": comparison}, indent=2))
    else:
        print(result.format())
        print(comparison["text"])
    return 0 if comparison["match"] else 1


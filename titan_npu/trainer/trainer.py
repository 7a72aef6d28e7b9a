"""The training loop, top to bottom: device, mesh, data, model on meta, parallelize, init, optimizer, then steps."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from titan_npu.checkpoint.live import live_state, load_live_state
from titan_npu.checkpoint.lock import refuse_if_owned
from titan_npu.checkpoint.manager import CheckpointManager
from titan_npu.config import JobConfig
from titan_npu.config.loader import config_to_dict
from titan_npu.config.validate import check_seq_len
from titan_npu.data import build_dataloader, build_tokenizer, check_vocab
from titan_npu.device import (
    empty_cache,
    memory_stats,
    peak_flops,
    reset_peak_memory,
    set_memory_fraction,
    setup_device,
    synchronize,
)
from titan_npu.lora.apply import lora_adapter
from titan_npu.metrics import (
    MetricsLogger,
    Progress,
    SpikeDetector,
    StepMeter,
    flops_per_token,
    health_flags,
    step_record,
)
from titan_npu.metrics.logger import import_wandb
from titan_npu.metrics.mixture import mixture_record
from titan_npu.metrics.report import final_report
from titan_npu.metrics.run_info import run_info, write_run_info
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.ops import current_kernels
from titan_npu.ops.cuda import choose_attention_kernel
from titan_npu.ops.documents import Documents
from titan_npu.ops.npu import set_rope_fp32
from titan_npu.parallel import ParallelDims, init_process_group, validate_layout
from titan_npu.parallel.context_parallel import ContextParallelBatch
from titan_npu.parallel.float8 import (
    check_float8_device,
    describe_float8,
    import_torchao,
    precompute_float8_scales,
    uses_float8_all_gather,
)
from titan_npu.parallel.layout import pp_microbatches
from titan_npu.parallel.parallelize import build_model_parts
from titan_npu.parallel.pipeline import build_part_optimizers, build_pipeline
from titan_npu.parallel.reduce import (
    clip_grad_norm_,
    global_token_count,
    loss_parallel_context,
    mean_loss,
    plain_tensor,
)
from titan_npu.profiling import build_profiler
from titan_npu.reliability import Reliability, prepare_reliability
from titan_npu.reliability.dirs import start_log_dir
from titan_npu.reliability.fault_tolerance import ReplicaGroups, replica_paths
from titan_npu.reliability.skip import step_unless, takes_device_flag
from titan_npu.trainer.advice import speed_hints
from titan_npu.trainer.loss import (
    cross_entropy_loss,
    model_loss,
    stand_in_labels,
    token_weight,
    token_weighted_loss,
    valid_labels,
)
from titan_npu.trainer.optimizer import build_lr_scheduler, build_optimizer
from titan_npu.trainer.precision import (
    autocast_context,
    build_grad_scaler,
    pure_param_dtype,
    set_fp32_matmul_precision,
    to_torch_dtype,
)
from titan_npu.trainer.routing import RoutingMeter, update_score_biases

log = logging.getLogger("titan_npu")


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every generator; in deterministic mode also force deterministic kernels."""
    torch.manual_seed(seed)
    if deterministic:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


class Trainer:
    """Builds everything a run needs from a JobConfig; `train()` runs the steps."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        t = cfg.training
        if cfg.fault_tolerance.enable:  # each replica group checkpoints and logs in its own folder
            replica_paths(cfg)

        # Device and process group: the runtime, allocator and collective variables the launcher has not set are set
        # first (those torch_npu reads at import the launcher set before importing torch), then the device is
        # decided and bound; determinism before any communicator exists.
        self.device = setup_device(cfg.parallel.backend, cfg.comm, deterministic=t.deterministic,
                                   task_queue=t.npu_task_queue)
        set_memory_fraction(self.device.type, self.device.index, t.memory_fraction)
        prepare_reliability(cfg, self.device.type)  # before the process group: it reads the flight recorder's size
        if cfg.checkpoint.enable:  # another run's checkpoint.dir: refused before this one allocates anything
            refuse_if_owned(cfg.checkpoint.dir)
        set_determinism(t.seed, t.deterministic)
        self.rank, self.world_size = init_process_group(self.device, cfg.comm)
        self.dims = ParallelDims.from_config(cfg.parallel, self.world_size)
        if self.world_size > 1:
            self.dims.build_mesh(self.device.type, cfg.comm.timeout_s)
        self.tf32 = set_fp32_matmul_precision(self.device.type, t.tf32, t.deterministic)
        # A missing optional package (wandb) stops the run before any real work; the sinks themselves open once
        # every check has passed, so that a refused run leaves nothing on disk.
        if cfg.metrics.wandb and self.rank == 0:
            import_wandb()

        # Model arguments and the checks that need both the model and the rest of the config.
        self.model_args = build_model_args(cfg.model)
        validate_layout(self.dims, self.model_args, cfg)
        check_seq_len(t.seq_len, self.model_args.max_seq_len)
        self.pure_dtype = pure_param_dtype(t.dtype, t.mixed_precision)
        if cfg.float8.enable:  # a device without float8 matmuls, or no torchao, stops the run here
            capability = torch.cuda.get_device_capability(self.device.torch_device) \
                if self.device.type == "cuda" else None
            check_float8_device(cfg.float8, self.device.type, capability, self.device.name)
            import_torchao()
        # Float8 weights all-gathered by FSDP2 take their scales from one all-reduce after each optimizer step.
        self.float8_scales = uses_float8_all_gather(cfg.float8, self.dims.dp_mode)

        # Data: every rank of a data-parallel group reads its own slice.
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        check_vocab(self.tokenizer, self.model_args.vocab_size)
        self.downstream = None
        if cfg.eval.enable:  # [eval]'s tasks checked (names, data on disk, few-shot pools) before any work
            from titan_npu.trainer.downstream import DownstreamEval

            self.downstream = DownstreamEval(cfg, self.tokenizer, self.model_args, self.device, self.rank)
        self.dp_rank, self.dp_degree = self.dims.dp_coordinates()
        self.dataloader = build_dataloader(
            cfg, self.tokenizer, self.dp_rank, self.dp_degree, split="train",
            device_type=self.device.type, model_vocab_size=self.model_args.vocab_size,
        )
        # Fault tolerance: this process group is one replica group of several (docs/reliability.md); each step's
        # quorum decides which groups average gradients and how the step's data is split among them.
        self.replicas = ReplicaGroups(cfg, self.rank, self.world_size, self.device.torch_device, self.dataloader,
                                      self.dp_rank, self.dp_degree) if cfg.fault_tolerance.enable else None

        # Model: built on meta (no memory), split into pipeline stages, parallelised, materialised on the device
        # with the seed's weights (the same in every layout). Pure bf16: weights, gradients and optimizer state
        # in bf16.
        stage_ids, self.model_parts = build_model_parts(spec_of(self.model_args), cfg, self.dims, self.model_args,
                                                        self.device.torch_device,
                                                        self.pure_dtype, adapt=lora_adapter(cfg.lora))
        self.model = self.model_parts[0]
        # A MoE model's auxiliary loss joins the optimised loss; its routing is logged (inert for dense models).
        self.routing = RoutingMeter(self.model)
        # The step's loss is the mean over the valid labels of the global batch (trainer/loss.py): each
        # micro-batch's mean is weighted by its valid labels over the step's (loss_tokens, summed over the ranks
        # holding different tokens) x the terms the step averages (micro-batches x those ranks).
        self.loss_tokens = 0
        self.pipeline = None
        if self.dims.pp_enabled:
            n_microbatches = pp_microbatches(cfg, self.dims)
            loss_fn = token_weighted_loss(cross_entropy_loss, n_microbatches * self.dims.dp * self.dims.cp,
                                          lambda: self.loss_tokens)
            self.pipeline = build_pipeline(self.model_parts, stage_ids, self.dims, cfg, self.device.torch_device,
                                           self.routing.pipeline_loss(self.model_parts, loss_fn, n_microbatches))

        # Optimizer, schedule, precision.
        self.optimizer = build_part_optimizers(
            self.model_parts, lambda parts: build_optimizer(parts, cfg.optimizer, self.device.type))
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.max_steps)
        # FSDP and replicate cast parameters themselves (no autocast then); DTensor gradients need the sharded scaler.
        self.autocast = autocast_context(self.device.type, t.dtype, sharded_mixed_precision=self.dims.dp_enabled,
                                         pure=self.pure_dtype is not None)
        self.grad_scaler = build_grad_scaler(self.device.type, t.dtype, self.dims.params_are_sharded)
        self.loss_context = lambda: loss_parallel_context(self.dims, cfg.parallel.loss_parallel)
        self.loss_chunk_tokens = self.dims.loss_chunk_tokens(t.loss_chunk_tokens)
        # Context parallel: every cp rank reads the same batch and keeps its chunks of each sequence.
        self.cp_batch = ContextParallelBatch(*self.dims.cp_coordinates()) if self.dims.cp_enabled else None

        # Metrics.
        self.step = 0
        self.tokens_seen = 0
        # Hooks (benchmarks and tests install them; a run has none): each called with the step number.
        self.step_start_callbacks: list[Callable[[int], None]] = []  # before each step's forward
        self.step_callbacks: list[Callable[[int], None]] = []  # after each step
        self.loss_hooks: list[Callable[[int, torch.Tensor], torch.Tensor]] = []  # (step, loss) -> the loss used
        # Reliability: skipped non-finite steps, preemption, the hang watchdog; its counters go into checkpoints.
        self.reliability = Reliability(cfg, self.rank, self.world_size, self.device.type,
                                       scaler_handles_overflow=self.grad_scaler is not None,
                                       device_flag=takes_device_flag(self.optimizer))
        extra = {"reliability": self.reliability}
        if self.grad_scaler is not None:
            extra["grad_scaler"] = self.grad_scaler
        # Checkpoints: resume (or start from checkpoint.initial_load) before the first step; sets step/tokens_seen.
        self.checkpointer = CheckpointManager(
            cfg, self.model_parts, getattr(self.optimizer, "optimizers", self.optimizer), self.lr_scheduler,
            self.dataloader, self,
            dp_rank=self.dp_rank, dp_degree=self.dp_degree, device_type=self.device.type, model_args=self.model_args,
            layout=self.dims.describe(), extra=extra,
        )
        self.checkpointer.load()
        if self.replicas is not None:  # a group behind its peers heals from their live state, not from a checkpoint
            run = self.checkpointer.run
            self.replicas.attach(lambda: live_state(run), lambda state: load_live_state(run, state), self)
        empty_cache(self.device)  # hand the load's staging buffers back before the first step allocates
        self.tokens_per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps * self.dims.dp
        self.flops_per_token = flops_per_token(  # a token meets only its experts of a MoE model: active parameters
            self.model_args.num_active_params(exclude_embedding=True), self.model_args.n_layers, self.model_args.dim,
            t.seq_len,
        )
        compute_dtype = to_torch_dtype(t.dtype)
        self.attention_kernel = choose_attention_kernel(
            self.device.torch_device, cfg.model.attention_backend, compute_dtype, self.model_args.n_heads,
            self.model_args.n_kv_heads, self.model_args.head_dim, t.seq_len,
        ) if self.device.type == "cuda" and self.model_args.use_flash_attention else ""
        set_rope_fp32(cfg.model.rope_fp32)
        self.peak_flops = peak_flops(self.device, compute_dtype, cfg.metrics.peak_tflops, tf32=self.tf32)
        if self.rank == 0:  # the marker of the run's files in metrics.log_dir, and config.toml
            start_log_dir(cfg)
        self.metrics = MetricsLogger(cfg.metrics.log_dir, self.rank, tensorboard=cfg.metrics.tensorboard,
                                     wandb=cfg.metrics.wandb, run_config=config_to_dict(cfg))
        if self.rank == 0:
            write_run_info(cfg.metrics.log_dir, run_info(
                self.model_args, self.dims.describe(), self.device, self.world_size, self.tokens_per_step,
                self.flops_per_token, self.peak_flops, cfg.checkpoint.dir,
                conversations=self.dataloader.conversation_counts()))
        self.meter = StepMeter(self.tokens_per_step, self.world_size, self.flops_per_token, self.peak_flops)
        self.spikes = SpikeDetector(cfg.metrics.spike_sigma, cfg.metrics.spike_window)
        self.progress = Progress(cfg.metrics.progress, t.max_steps, enabled=self.rank == 0)
        self.profiler = build_profiler(cfg.profiling, self.rank, self.device.type)
        self.validator = None
        if cfg.validation.enable:
            from titan_npu.trainer.validate import Validator

            dp_group = self.dims.token_mesh.get_group() if self.world_size > 1 else None
            self.validator = Validator(cfg, self.tokenizer, self.dp_rank, self.dp_degree, self.device,
                                       self.model_args.vocab_size, dp_group, self.cp_batch)
        self._log_start()

    def _log_start(self) -> None:
        a, t = self.model_args, self.cfg.training
        n_params = a.num_params()
        log.info(
            "model %s %s: %.1fM params (dim=%d, layers=%d, heads=%d/%d kv, vocab=%d) on %s (%s, backend %s)",
            a.family, a.flavor, n_params / 1e6, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size,
            self.device.type, self.device.name, self.device.backend,
        )
        log.info("layout: %s", self.dims.describe())
        if self.cfg.lora.enable:
            trainable = sum(p.numel() for part in self.model_parts for p in part.parameters() if p.requires_grad)
            adapted = sum(hasattr(m, "lora_A") for part in self.model_parts for m in part.modules())
            lora = self.cfg.lora
            log.info("lora: rank %d, alpha %g on %d linears of this rank's stages (target_modules %s): %.3fM "
                     "trainable parameters, the rest frozen", lora.rank, lora.alpha, adapted,
                     ", ".join(lora.target_modules), trainable / 1e6)
        if self.pipeline is not None:
            p = self.cfg.parallel
            log.info("pipeline: %s, %d stages (%d on this rank), %d microbatches of %d sequences per step",
                     p.pp_schedule, self.pipeline.stages[0].num_stages, len(self.pipeline.stages),
                     self.pipeline.n_microbatches, t.batch_size * t.gradient_accumulation_steps
                     // self.pipeline.n_microbatches)
        kernels = ", ".join(f"{op}={backend}" for op, backend in current_kernels(self.device.type).items())
        eager = "" if a.use_flash_attention else " (use_flash_attention=false: eager attention)"
        sdpa = f" (sdpa: {self.attention_kernel})" if self.attention_kernel else ""
        log.info("kernels: %s%s%s", kernels, eager, sdpa)
        if self.cfg.float8.enable:
            log.info(describe_float8(self.cfg.float8, self.model_parts))
        if self.cfg.activation_checkpoint.offload:
            blocks = sum(p.activation_offload.blocks for p in self.model_parts if hasattr(p, "activation_offload"))
            log.info("activation offload: the saved activations of %d block(s) on this rank (those not recomputed) "
                     "go to host memory, tensors from %d bytes", blocks,
                     self.cfg.activation_checkpoint.offload_min_bytes)
        log.info("loss: %s", f"output projection + cross entropy in chunks of {self.loss_chunk_tokens} tokens"
                 if self.loss_chunk_tokens else "whole logits (tensor/pipeline parallel, or loss_chunk_tokens = 0)")
        for hint in speed_hints(self.cfg, self.device.type) if self.rank == 0 else []:
            log.warning(hint)
        log.info(
            "global batch: %d sequences x %d tokens = %d tokens/step (batch_size=%d x grad_accum=%d x dp=%d), "
            "dtype=%s, peak %.3g TFLOP/s per device",
            self.tokens_per_step // t.seq_len, t.seq_len, self.tokens_per_step, t.batch_size,
            t.gradient_accumulation_steps, self.dims.dp, t.dtype, self.peak_flops / 1e12,
        )
        if self.replicas is not None:
            log.info("fault tolerance: that batch is one replica group's; a step trains it once per group taking "
                     "part (up to %d)", self.cfg.fault_tolerance.num_replica_groups)

    def _local_valid_labels(self, labels: torch.Tensor) -> int:
        """The valid labels of a host batch that this rank's loss sees (its chunks under context parallelism)."""
        return valid_labels(labels if self.cp_batch is None else self.cp_batch.local(labels))

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
                         documents: Documents | None = None, weight: float = 1.0) -> torch.Tensor:
        """One micro-batch: forward, loss, backward; returns its weighted, unscaled loss (detached). documents: the
        batch's (data.document_mask), whole windows also under context parallelism. weight: its token_weight
        (0 for a micro-batch without a valid label on this rank, which then runs on a stand-in label)."""
        if self.cp_batch is not None:
            inputs, labels = self.cp_batch.split(inputs, labels)
        if weight == 0.0:
            labels = stand_in_labels(labels)
        with self.loss_context():  # vocab-sharded logits under TP: the loss and its backward run sharded
            loss = model_loss(self.model, inputs, labels, self.autocast, self.loss_chunk_tokens, documents)
            loss = loss * weight  # exactly the mean when the weight is 1 (every label valid)
            for hook in self.loss_hooks:
                loss = hook(self.step, loss)
            scaled = self.routing.add_auxiliary(loss, scale) * scale
            if self.grad_scaler is not None:
                scaled = self.grad_scaler.scale(scaled)
            scaled.backward()
        return plain_tensor(loss.detach())

    def pipeline_forward_backward(self, data_iter) -> tuple[torch.Tensor, float]:
        """One pipeline step: the accumulation steps' batches (and their documents, with data.document_mask) become
        microbatches; (loss or 0 off the last stage, data seconds)."""
        t0 = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.cfg.training.gradient_accumulation_steps)]
        inputs = torch.cat([b[0] for b in batches]).to(self.device.torch_device, non_blocking=True)
        labels = torch.cat([b[1] for b in batches]).to(self.device.torch_device, non_blocking=True)
        documents = None
        if len(batches[0]) > 2:  # data.document_mask: each microbatch's documents, split on the host up front
            whole = Documents.cat([b[2] for b in batches])
            documents = [d.to(self.device.torch_device, non_blocking=True)
                         for d in whole.split(self.pipeline.n_microbatches)]
        # The step's valid labels, counted on the host: the schedule's loss function weights each microbatch by them.
        self.loss_tokens = global_token_count(sum(self._local_valid_labels(b[1]) for b in batches), self.dims)
        if self.cp_batch is not None:  # the local chunks
            inputs, labels = self.cp_batch.split(inputs, labels)
        data_time = time.perf_counter() - t0
        with self.autocast(), self.loss_context():
            loss = self.pipeline.step(inputs, labels, documents)
        return (loss if loss is not None else torch.zeros((), device=self.device.torch_device)), data_time

    def train_step(self, data_iter) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over gradient_accumulation_steps micro-batches; (loss, grad_norm, data seconds)."""
        accum = self.cfg.training.gradient_accumulation_steps
        data_time = 0.0
        self.routing.begin_step()
        loss_sum = torch.zeros((), device=self.device.torch_device)
        if self.pipeline is not None:
            loss_sum, data_time = self.pipeline_forward_backward(data_iter)
            loss_sum = loss_sum * accum
        else:
            # Every micro-batch of the step first: the weights need the step's valid labels, counted on the host
            # before the labels move (one all-reduce of the count, no device read).
            t0 = time.perf_counter()
            batches = [next(data_iter) for _ in range(accum)]  # (inputs, labels, *documents: data.document_mask)
            counts = [self._local_valid_labels(batch[1]) for batch in batches]
            self.loss_tokens = global_token_count(sum(counts), self.dims)
            share = accum * self.dims.dp * self.dims.cp
            data_time += time.perf_counter() - t0
            for (inputs, labels, *documents), count in zip(batches, counts, strict=True):
                t0 = time.perf_counter()
                inputs = inputs.to(self.device.torch_device, non_blocking=True)
                labels = labels.to(self.device.torch_device, non_blocking=True)
                docs = documents[0].to(self.device.torch_device, non_blocking=True) if documents else None
                data_time += time.perf_counter() - t0
                loss_sum += self.forward_backward(inputs, labels, 1.0 / accum, docs,
                                                  token_weight(count, share, self.loss_tokens))
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]  # LoRA: adapters
        if self.replicas is not None:  # before clipping: every replica group clips the same averaged gradients
            self.replicas.average_gradients(params)
        # The norm over every parameter of the model, wherever its shards and stages live.
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, self.dims)
        # Collective: every rank learns of a signal on any rank, and all skip the update of a non-finite step.
        skip = self.reliability.check_step(self.step, loss_sum / accum, grad_norm)
        if self.replicas is not None and not self.replicas.should_commit():  # the replica set broke mid-step
            self.optimizer.zero_grad(set_to_none=True)
            return loss_sum / accum, grad_norm, data_time
        if self.grad_scaler is not None:
            if skip is not True:
                self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()  # the scale still backs off from an overflow that came with a bad step
        elif isinstance(skip, torch.Tensor):
            step_unless(self.optimizer, skip)  # decided on the device: no host read
        elif not skip:
            self.optimizer.step()
        if self.float8_scales:
            precompute_float8_scales(self.model_parts)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_scaler is not None and skip is not True:  # the scaler skipped it where the gradients overflowed
            skip = (~torch.isfinite(plain_tensor(grad_norm.detach()))).float()
        if not self.cfg.lora.enable:  # LoRA: the routers' score biases are the frozen base's too
            update_score_biases(self.routing, self.dims, skip)  # not on a skipped update
        return loss_sum / accum, grad_norm, data_time

    def _global_mean(self, value: torch.Tensor) -> float:
        """The step loss averaged over the data-parallel ranks (a collective: call it on every rank).

        Only the last pipeline stage computes the loss; the other stages' zeros are left out of the mean.
        """
        holds_loss = self.pipeline is None or self.pipeline.has_last
        return mean_loss(value if holds_loss else None, self.dims)

    def train(self) -> dict[str, Any]:
        """Run until training.max_steps; returns the last logged metrics."""
        cfg = self.cfg
        max_steps, interval = cfg.training.max_steps, cfg.metrics.log_interval
        if self.step >= max_steps and self.rank == 0:
            log.warning("nothing to train: the run resumed at step %d and training.max_steps is %d; raise "
                        "--training.max_steps to continue it, or give another --checkpoint_dir to start a new run",
                        self.step, max_steps)
        data_iter = iter(self.dataloader)
        last: dict[str, Any] = {}
        synchronize(self.device)
        reset_peak_memory(self.device)
        self.meter.start(next_step=self.step + 1)
        for part in self.model_parts:
            part.train()
        self.profiler.start(self.step)
        self.reliability.start()
        while self.step < max_steps:
            if self.replicas is not None:
                self.replicas.begin_step()  # the quorum of replica groups; a group behind heals here (sets self.step)
                if self.step >= max_steps:
                    break
            self.step += 1
            self.reliability.begin_step(self.step)
            for callback in self.step_start_callbacks:
                callback(self.step)
            loss, grad_norm, data_time = self.train_step(data_iter)
            if self.replicas is not None and not self.replicas.committed:
                self.step -= 1  # not taken by the replica groups: the same step and data run again
                continue
            self.tokens_seen += self.tokens_per_step * (self.replicas.participants if self.replicas else 1)
            self.meter.step(loss, data_time)
            self.progress.update(self.step, last.get("loss"))
            if self.step % interval == 0 or self.step == max_steps or self.step == 1:
                self.reliability.settle()  # count the skips since the last log step (may request the halt)
                last = self._log_step(loss, grad_norm)
            if self.validator is not None and self.validator.due(self.step, max_steps):
                with self.meter.excluded(), self.reliability.phase("validation"):
                    record = self.validator.run(self.model, self.step, self.autocast, self.loss_context)
                    self.metrics.log_validation(record)
            if self.downstream is not None and self.downstream.due(self.step, max_steps):
                with self.meter.excluded(), self.reliability.phase("eval"):
                    record = self.downstream.run(self.model_parts, self.step)
                    if record is not None:
                        self.metrics.log_eval(record)
            # Saves count as training time (like the outside clock): a blocking save shows as a dip in its window.
            self.reliability.maybe_save(self.checkpointer, self.step, last_step=self.step == max_steps)
            if self.reliability.stop_requested:  # a signal (exit 0 after the save) or too many skips (raises)
                self.reliability.stop(self.checkpointer, self.step)
                break
            self.profiler.step()
            for callback in self.step_callbacks:
                callback(self.step)
        self.reliability.finish()
        self.profiler.stop()
        self.progress.close()
        self.metrics.close()
        if self.rank == 0 and cfg.metrics.report and not self.reliability.stop_requested:
            final_report(cfg.metrics.log_dir)
        return last

    def _log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, Any]:
        """The only synchronisation of the loop: read the device's numbers and the clock, write every sink."""
        loss_value = self._global_mean(loss)
        norm_value = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        synchronize(self.device)
        window = self.meter.window()
        record = step_record(self.step, loss_value, self.lr_scheduler.get_last_lr()[0], norm_value,
                             self.meter.throughput(window), window, memory_stats(self.device), self.tokens_seen)
        record["loss_tokens"] = self.loss_tokens  # the step's valid labels, over every rank
        record["eta_s"] = self.progress.eta_seconds()
        record["skipped_steps"] = self.reliability.guard.total
        if self.replicas is not None:
            record["replicas"] = self.replicas.participants
        record.update(self.routing.record(self.dims))
        record.update(mixture_record(self.dataloader.source_tokens()))
        flags = health_flags(window.first_step, window.losses, norm_value, self.spikes)
        if flags:
            record["flags"] = flags
        self.metrics.log(record)
        return record

    def close(self) -> None:
        """Release sinks and the process group."""
        from titan_npu.parallel import destroy_process_group

        self.reliability.finish()
        self.checkpointer.close()
        if self.replicas is not None:
            self.replicas.close()
        self.metrics.close()
        destroy_process_group()

"""The config schema: one dataclass per section, canonical names only (aliases live in aliases.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The [model] keys every family shares and the framework itself reads; every other [model] key is a family's own,
# declared with its range in the family's folder (ModelSpec.model_keys) and held in ModelConfig.keys.
SHARED_MODEL_KEYS = ("name", "flavor", "use_flash_attention", "attention_backend", "rope_fp32")


@dataclass(init=False, eq=False)
class ModelConfig:
    """Model family, preset size, the framework's switches, and the family's own keys that override the preset
    (`keys`: canonical key -> value; a key left out takes the flavor's value)."""

    # a family of models/registry.py, optionally sized (llama3_8b)
    name: str = "llama3"
    flavor: str = "debug"
    use_flash_attention: bool = True
    attention_backend: str = "auto"  # CUDA SDPA kernel: auto (by GPU capability) | cudnn | flash | efficient
    rope_fp32: bool = False  # NPU: npu_rotary_mul on fp32 q/k and tables (cast back), as torchtitan-npu runs RoPE

    def __init__(self, name: str = "llama3", flavor: str = "debug", use_flash_attention: bool = True,
                 attention_backend: str = "auto", rope_fp32: bool = False, **keys: Any) -> None:
        object.__setattr__(self, "keys", {})
        self.name, self.flavor = name, flavor
        self.use_flash_attention, self.attention_backend, self.rope_fp32 = (use_flash_attention, attention_backend,
                                                                            rope_fp32)
        for key, value in keys.items():
            setattr(self, key, value)

    def __getattr__(self, key: str) -> Any:
        """A family key's value (None when unset: the flavor's); AttributeError for a name no family has."""
        if key.startswith("_") or key == "keys":
            raise AttributeError(key)
        if key in self.keys:
            return self.keys[key]
        from titan_npu.config.options import model_key_rows  # the families' keys (imports torch)

        if f"model.{key}" in model_key_rows():
            return None
        raise AttributeError(f"ModelConfig has no key {key!r}")

    def __setattr__(self, key: str, value: Any) -> None:
        if key in SHARED_MODEL_KEYS:
            object.__setattr__(self, key, value)
        elif value is None:
            self.keys.pop(key, None)  # unset: the flavor's value
        else:
            self.keys[key] = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelConfig):
            return NotImplemented
        shared = all(getattr(self, k) == getattr(other, k) for k in SHARED_MODEL_KEYS)
        return shared and self.keys == other.keys

    def __repr__(self) -> str:
        shared = ", ".join(f"{k}={getattr(self, k)!r}" for k in SHARED_MODEL_KEYS)
        own = "".join(f", {k}={v!r}" for k, v in self.keys.items())
        return f"ModelConfig({shared}{own})"

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelConfig:
        import copy

        return ModelConfig(**{k: getattr(self, k) for k in SHARED_MODEL_KEYS}, **copy.deepcopy(self.keys, memo))


@dataclass
class TrainingConfig:
    batch_size: int = 8
    seq_len: int = 256
    gradient_accumulation_steps: int = 1
    max_steps: int = 1000
    dtype: str = "bf16"  # bf16 | fp16 | fp32
    max_norm: float = 1.0
    seed: int = 42
    deterministic: bool = False
    # tokens whose logits the loss computes at a time (the output projection and cross entropy, chunk by chunk);
    # 0 = the whole micro-batch's logits at once. Tensor and pipeline parallel runs always take the whole logits.
    loss_chunk_tokens: int = 2048
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa products); off when deterministic
    memory_fraction: float = 0.0  # cap of this process's share of device memory, (0, 1]; 0 = no cap
    # NPU: torch_npu's task-queue level, TASK_QUEUE_ENABLE: 0 = off, 1 = training (torch_npu's default), 2 = pure
    # inference only (torch_npu/npu/utils.py, set_task_queue_enable)
    npu_task_queue: int = 1
    # bf16/fp16: fp32 parameters and optimizer state, compute cast to dtype (true); false = "pure": parameters,
    # gradients and optimizer state held in dtype itself (bf16 only)
    mixed_precision: bool = True


@dataclass
class OptimizerConfig:
    name: str = "AdamW"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "auto"  # auto | fused | foreach | for-loop
    # name = "Muon": matrices (and stacked experts) not matched by muon_exclude take Muon; the rest AdamW (above)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    muon_ns_dtype: str = "bf16"  # bf16 | fp32: the dtype the Newton-Schulz iteration runs in
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (reuses AdamW's lr) | original | none
    # fnmatch patterns of parameter names (wrapper prefixes dropped) that stay on AdamW although they are matrices
    muon_exclude: list[str] = field(default_factory=lambda: ["tok_embeddings.*", "output.*"])
    # Adam/AdamW moments (and those of the AdamW part of Muon): fp32 | bf16 (stored rounded to nearest, updated in
    # fp32; docs/optimizers.md)
    state_dtype: str = "fp32"


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 200
    decay_type: str = "cosine"  # cosine | linear | constant | wsd
    min_lr_ratio: float = 0.1
    decay_ratio: float = 0.1  # wsd: fraction of steps spent decaying at the end


@dataclass
class ParallelConfig:
    backend: str = "auto"  # auto | hccl | nccl | gloo
    dp_replicate: int = 1
    dp_shard: int = -1
    fsdp: bool = True
    tp_degree: int = 1
    pp_degree: int = 1
    pp_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV
    pp_microbatches: int = 0
    pp_virtual_stages: int = 0  # stages per rank; 0 = 2 for the interleaved and V schedules, else 1
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    loss_parallel: bool = True
    cp_degree: int = 1  # context parallel: ranks each sequence is split over (docs/long_context.md)
    cp_mode: str = "ring"  # ring, ulysses, or hybrid: Ulysses within groups of cp_ulysses_degree ranks, ring between
    cp_ulysses_degree: int = 2  # hybrid: adjacent cp ranks of one Ulysses group (divides cp_degree, below it)
    ep_degree: int = 1  # expert parallel: ranks (from dp_shard x cp) the MoE experts are split over (docs/moe.md)


@dataclass
class Float8Config:
    """float8 matmuls through torchao (docs/float8.md); off by default, weights and checkpoints stay high precision."""

    enable: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise (torchao's dynamic scaling recipes)
    emulate: bool = False  # float8 casts with high-precision matmuls, on any device (CPU tests; not faster)
    # linears whose name contains one of these stay in the training dtype (the output projection, MoE routers)
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router.gate"])
    # also skip linears too small to gain on H100-class parts (torchao's per-recipe size rule); a linear whose
    # dims are not multiples of 16 is always skipped (the float8 GEMM needs them)
    auto_filter_small_kn: bool = True
    # tensorwise under FSDP2: all-gather weights in float8 (half the bytes), scales precomputed after each step
    fsdp_float8_all_gather: bool = True
    # the MoE routed experts' grouped GEMMs in float8 too (torchao's prototype grouped GEMMs; docs/float8.md)
    moe_experts: bool = False
    moe_recipe: str = "rowwise"  # rowwise (float8 rowwise, CUDA sm90+) | mxfp8 (blocks of 32, CUDA sm100+; emulated)


@dataclass
class ActivationCheckpointConfig:
    mode: str = "none"  # none | selective | full
    selective_every: int = 2  # selective: checkpoint every Nth block
    selective_ops: bool = False  # selective: in every block keep matmul/attention outputs, recompute the rest
    # the saved activations of the blocks not recomputed go to (pinned) host memory during forward and come back
    # before their backward (docs/parallelism.md); tensors under offload_min_bytes stay on the device
    offload: bool = False
    offload_min_bytes: int = 1048576


@dataclass
class CompileConfig:
    enable: bool = False
    backend: str = "inductor"  # torch.compile backend per transformer block


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    save_interval: int = 1000
    keep_last_n: int = 3
    async_save: bool = True
    resume: str = "auto"  # auto | never | <path or step>
    export_dtype: str = "bf16"
    initial_load: str = ""  # pretrained weights to start from (HF dir, Meta .pth, our .pt)
    initial_load_model_only: bool = True
    enable: bool = True
    overwrite: bool = False  # let resume=never / an older step replace the checkpoints already in dir
    allow_model_change: bool = False  # resume although [model] differs from the checkpoint's saved model definition
    convert_optimizer_state: bool = False  # resume a checkpoint whose optimizer.state_dtype differs, converting it


@dataclass
class DataSource:
    """One source of a data mixture ([[data.sources]]): its own path, weight and text field (docs/data.md)."""

    name: str = ""  # "" = the path's file or folder name
    path: str = ""  # anything data.path accepts
    weight: float = 1.0  # normalised over the sources
    text_field: str = ""  # "" = data.text_field
    max_epochs: int = 0  # 0 = as many passes as the run needs; else the run stops rather than pass it


@dataclass
class DataConfig:
    path: str = ""  # "" = the corpus that ships with the project
    sources: list[DataSource] = field(default_factory=list)  # a weighted mixture instead of data.path
    tokenizer: str = "byte"
    num_workers: int = 2
    text_field: str = "text"
    val_fraction: float = 0.0
    document_mask: bool = False  # attention stops at document boundaries inside packed windows
    reset_position_ids: bool = False  # with document_mask: RoPE positions restart at 0 at each document start
    # Supervised fine-tuning data (docs/sft.md): chat or instruction records, the loss on assistant tokens only.
    format: str = "text"  # text | chat ({"messages": [...]}) | instruction (prompt / response fields)
    chat_template: str = ""  # a .jinja file (or a tokenizer_config.json) overriding the tokenizer's chat_template
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str = "system"  # instruction records: an optional system prompt
    pack: bool = True  # several conversations per window (document masking keeps them apart); false = one, padded
    overlong: str = "truncate"  # a conversation over seq_len + 1 tokens: truncate (cut its end) | drop
    skip_bad_records: bool = False  # count and skip malformed records instead of refusing the first


@dataclass
class MetricsConfig:
    log_dir: str = "logs"
    log_interval: int = 10
    tensorboard: bool = True
    wandb: bool = False
    peak_tflops: float = 0.0  # 0 = detect from the device
    progress: str = "auto"  # auto | bar | lines
    spike_sigma: float = 4.0  # flag a step whose loss is this many std devs above the recent window
    spike_window: int = 100  # steps in that window
    report: bool = True  # write report.png / report.md into log_dir at the end of a run


@dataclass
class ValidationConfig:
    enable: bool = False
    interval: int = 500
    steps: int = 10
    data: str = ""


@dataclass
class EvalConfig:
    """Downstream tasks through lm-evaluation-harness on the run's current weights (docs/evaluation.md)."""

    enable: bool = False
    tasks: list[str] = field(default_factory=lambda: ["titan_mc"])  # lm_eval task names (shipped or installed)
    interval: int = 500  # steps between evaluations (and one at the last step)
    limit: int = 0  # examples per task; 0 = all
    num_fewshot: int = -1  # examples in each prompt; -1 = the task's own
    batch_size: int = 8  # requests per forward


@dataclass
class ProfilingConfig:
    enable: bool = False
    start_step: int = 10
    active_steps: int = 3
    trace_dir: str = "profile"
    record_shapes: bool = True
    profile_memory: bool = True
    ranks: list[int] = field(default_factory=lambda: [0])  # [] or [-1] = every rank
    level: str = "Level1"  # torch_npu profiler level: Level0 | Level1 | Level2 (ignored off NPU)
    with_stack: bool = False


@dataclass
class CommConfig:
    init_timeout_s: int = 1800
    join_timeout_s: int = 300  # every rank must reach the job's store within this; else a one-line error names them
    timeout_s: int = 1800
    hccl_buffsize_mb: int = 0
    hccl_if_base_port: int = 0  # -> HCCL_IF_BASE_PORT (first of the ports HCCL listens on); 0 = leave as is
    socket_ifname: str = ""  # -> HCCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME; "" = leave as is


@dataclass
class ReliabilityConfig:
    """What a long run does about NaNs, signals, hangs and full disks (docs/reliability.md)."""

    skip_nonfinite: bool = True  # skip the update of a step whose loss or grad_norm is NaN/inf
    max_skipped_steps: int = 10  # consecutive skipped steps after which the run stops with a checkpoint
    spike_skip_sigma: float = 0.0  # > 0: also skip a step whose loss is this many std devs above the recent window
    handle_signals: bool = True  # SIGTERM/SIGINT: every rank checkpoints at the step boundary, then exits 0
    watchdog: bool = True  # a step or save that runs too long dumps every thread's stack and exits non-zero
    watchdog_timeout_s: float = 0.0  # the watchdog's limit; 0 = comm.timeout_s
    watchdog_step_factor: float = 0.0  # > 0: also fire at this multiple of the median step time
    flight_recorder_size: int = 2000  # collectives kept for the hang dump; 0 = no flight recorder
    disk_margin: float = 1.1  # a save needs free space >= this x the checkpoint's size, else it is skipped


@dataclass
class FaultToleranceConfig:
    """Replica groups that outlive each other's failures, coordinated by a torchft lighthouse (docs/reliability.md)."""

    enable: bool = False
    replica_id: int = 0  # this replica group, 0 .. num_replica_groups - 1 (one torchrun per group)
    num_replica_groups: int = 1  # replica groups the job has when all are up; the data is split for this many at most
    lighthouse: str = ""  # http://host:port of torchft_lighthouse; "" = the TORCHFT_LIGHTHOUSE environment variable
    min_replicas: int = 1  # a step commits only when at least this many replica groups took part
    timeout_s: int = 60  # collectives, live-weight transfers and commit votes between groups
    quorum_timeout_s: int = 120  # how long a step waits for the replica set to form
    connect_timeout_s: int = 10  # reaching the lighthouse and the peers; an unreachable lighthouse fails within this
    hostname: str = ""  # the name or address the other groups reach this one at; "" = this machine's hostname


# The modules LoRA wraps by default: attention (MLA's too) and dense / shared-expert MLP projections, by last name.
LORA_DEFAULT_TARGETS = ["wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w2", "w3"]


@dataclass
class LoraConfig:
    """Low-rank adapters (docs/lora.md): the model's weights frozen, only W + (alpha/rank) B A's A and B trained."""

    enable: bool = False
    rank: int = 8  # r: the inner dim of B [out, r] and A [r, in]
    alpha: float = 16.0  # the update is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)
    dropout: float = 0.0  # on the adapter's input, as peft's lora_dropout
    use_rslora: bool = False  # peft's rank-stabilised scale alpha / sqrt(rank)
    # fnmatch patterns on module names: one matches a module by its whole name (layers.*.attention.wq) or its last
    # component (wq)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    experts: bool = False  # MoE routed experts too (not supported: refused)


@dataclass
class JobConfig:
    """The whole run: every section of a config file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

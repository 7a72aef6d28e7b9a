"""How a job is laid out for the planner: the parallel degrees, checkpointing and batch split (Layout), what it
trains (Job), both read from a config, and where a rank sits on the device mesh."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, TypeVar

from titan_npu.config.schema import Float8Config, JobConfig
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.models.registry import build_model_args
from titan_npu.parallel import arithmetic
from titan_npu.parallel.degrees import Degrees

GiB = 1024**3
MiB = 1024**2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
AC_MODES = ("none", "selective", "full")
MAX_LAYERS = 10_000  # the deepest model the planner plans: its terms are added up layer by layer
T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    """How one job is laid out: its parallel Degrees, activation checkpointing and the batch split per rank.

    The degrees and what follows from them read through (layout.tp, layout.fsdp_shards, layout.rank_coordinates).
    """

    degrees: Degrees = Degrees()
    ac: str = "none"  # none | selective | full
    selective_every: int = 2
    selective_ops: bool = False
    batch_size: int = 1  # training.batch_size: sequences per rank per forward (per accumulation step)
    grad_accum: int = 1
    pp_microbatches: int = 0  # 0 = 2 * pp
    pp_schedule: str = "1F1B"
    pp_virtual_stages: int = 0  # 0 = 2 for Interleaved1F1B, else 1
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    loss_parallel: bool = True
    loss_chunk_tokens: int = 0  # training.loss_chunk_tokens; 0 = the whole logits at once
    act_offload: bool = False  # activation_checkpoint.offload: the kept blocks' saved tensors go to host memory
    offload_min_bytes: int = MiB  # activation_checkpoint.offload_min_bytes

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "selective_every"):
            if getattr(self, name) < 1:
                raise LayoutError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.ac not in AC_MODES:
            raise LayoutError(f"activation_checkpoint.mode={self.ac!r} is unknown (choose {', '.join(AC_MODES)})")
        if self.pp > 1 and self.local_batch % self.n_microbatches:
            raise LayoutError(
                f"{self.local_batch} sequences per pipeline step (batch_size x gradient_accumulation_steps) do not "
                f"split into {self.n_microbatches} micro-batches; make them a multiple of parallel.pp_microbatches"
            )

    @property
    def sharding(self) -> tuple[Degrees, int, bool]:
        """What a rank's parameter shards and pipeline stages follow from: the degrees, the stages per pp rank and
        whether they are placed in a V (the key the planner's per-job tables are kept under)."""
        return self.degrees, self.stages_per_rank, self.pp > 1 and self.pp_schedule in arithmetic.V_SCHEDULES

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the loss's output projection, as the trainer's (Degrees.loss_chunk_tokens)."""
        return self.degrees.loss_chunk_tokens(self.loss_chunk_tokens)

    @property
    def sequence_parallel(self) -> bool:
        """The tensor-parallel plan keeps norms and the residual stream split over the sequence."""
        return self.tp > 1

    @property
    def local_batch(self) -> int:
        """Sequences one data-parallel rank processes per optimizer step."""
        return arithmetic.local_batch(self.batch_size, self.grad_accum)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank runs (1 without pipelining)."""
        return arithmetic.stages_per_rank(self.pp_schedule, self.pp_virtual_stages) if self.pp > 1 else 1

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP frees the gathered parameters after forward (the trainer's rule: not under a split
        backward, whose weight step needs them)."""
        return arithmetic.reshards_after_forward(self.reshard_after_forward, self.pp, self.pp_schedule)

    @property
    def n_microbatches(self) -> int:
        """Pipeline micro-batches per step: under pipelining the accumulation steps become micro-batches."""
        return arithmetic.microbatches(self.pp_microbatches, self.pp) if self.pp > 1 else 1

    @property
    def micro_batch(self) -> int:
        """Sequences in one forward/backward pass of one stage."""
        return self.local_batch // self.n_microbatches if self.pp > 1 else self.batch_size

    @property
    def passes(self) -> int:
        """Forward/backward passes per optimizer step (accumulation steps, or pipeline micro-batches)."""
        return self.n_microbatches if self.pp > 1 else self.grad_accum

    def describe(self) -> str:
        """One line: degrees, activation checkpointing and batch split."""
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.cp > 1:
            hybrid = f" ulysses {self.cp_ulysses} x ring {self.cp // self.cp_ulysses}" if self.cp_ulysses > 1 else ""
            parts.append(f"cp={self.cp} ({self.cp_mode}{hybrid})")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if not self.fsdp:
            parts.append("fsdp=off")
        if self.cpu_offload:
            parts.append("cpu_offload")
        if self.act_offload:
            parts.append("activation offload")
        if self.ac == "selective":
            ac = "selective ops" if self.selective_ops else f"selective 1/{self.selective_every}"
        else:
            ac = self.ac
        if self.pp > 1:
            batch = (f"{self.n_microbatches} micro-batches of {self.micro_batch} per step ({self.pp_schedule}, "
                     f"{self.stages_per_rank} stage(s) per rank)")
        else:
            batch = f"micro-batch {self.batch_size} x accum {self.grad_accum}"
        return f"{' '.join(parts)}, AC {ac}, {batch}"


def _read_through(name: str) -> property:
    """A Degrees attribute read through a Layout: layout.tp is layout.degrees.tp (a C-level getter: the search reads
    millions of them)."""
    return property(attrgetter(f"degrees.{name}"), doc=f"layout.degrees.{name}")


for _name in dir(Degrees):
    if not _name.startswith("_") and _name not in vars(Layout) and _name != "from_config":
        setattr(Layout, _name, _read_through(_name))


@dataclass(frozen=True)
class Job:
    """What the estimate needs from the config besides the layout."""

    args: Any  # the model's args (models/spec.py)
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    momentum: float = 0.9  # SGD keeps a momentum buffer only when this is non-zero
    muon_exclude: tuple[str, ...] = ()  # Muon: name patterns of the matrices left to AdamW
    state_dtype: str = "fp32"  # optimizer.state_dtype: the dtype of Adam's moments (fp32 parameters)
    float8: Float8Config | None = None  # float8 matmuls (float8.enable); None = off
    lora_rank: int = 0  # LoRA's rank ([lora] enable); 0 = off: every parameter trains
    lora_targets: tuple[str, ...] = ()  # lora.target_modules
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """compute(), once per `key` for this job: a search sizes thousands of layouts that share their shards and
        stages. The key holds every input besides the job's own fields (a job and its args are not changed once
        made)."""
        if key not in self._tables:
            self._tables[key] = compute()
        return self._tables[key]


def job_from_config(cfg: JobConfig) -> Job:
    """The model and training settings of a config, resolved; ConfigError past MAX_LAYERS layers."""
    args = build_model_args(cfg.model)
    if args.n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers = {args.n_layers}: the planner adds up its estimates layer by layer and "
                          f"plans models of at most {MAX_LAYERS:,} layers (published models have under 200); set "
                          f"a smaller model.n_layers")
    return Job(
        args=args,
        seq_len=cfg.training.seq_len,
        dtype=cfg.training.dtype,
        optimizer=cfg.optimizer.name.lower(),
        momentum=float(cfg.optimizer.betas[0]) if cfg.optimizer.betas else 0.0,
        muon_exclude=tuple(cfg.optimizer.muon_exclude),
        state_dtype=cfg.optimizer.state_dtype,
        float8=cfg.float8 if cfg.float8.enable else None,
        lora_rank=cfg.lora.rank if cfg.lora.enable else 0,
        lora_targets=tuple(cfg.lora.target_modules) if cfg.lora.enable else (),
    )


def layout_from_config(cfg: JobConfig, world_size: int) -> Layout:
    """The config's layout on `world_size` ranks (its degrees resolved as the trainer resolves them)."""
    return layout_with_degrees(cfg, Degrees.from_config(cfg.parallel, world_size))


def layout_with_degrees(cfg: JobConfig, degrees: Degrees) -> Layout:
    """The config's checkpointing and batch split with the given degrees."""
    p, ac = cfg.parallel, cfg.activation_checkpoint
    return Layout(
        degrees=degrees,
        ac=ac.mode,
        selective_every=ac.selective_every,
        selective_ops=ac.selective_ops,
        batch_size=cfg.training.batch_size,
        grad_accum=cfg.training.gradient_accumulation_steps,
        pp_microbatches=p.pp_microbatches,
        pp_schedule=p.pp_schedule,
        pp_virtual_stages=p.pp_virtual_stages,
        cpu_offload=p.cpu_offload,
        reshard_after_forward=p.reshard_after_forward,
        loss_parallel=p.loss_parallel,
        loss_chunk_tokens=cfg.training.loss_chunk_tokens,
        act_offload=ac.offload,
        offload_min_bytes=ac.offload_min_bytes,
    )

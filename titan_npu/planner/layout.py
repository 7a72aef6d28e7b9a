"""How a job is laid out for the planner: the parallel degrees, checkpointing and batch split (Layout), what it
trains (Job), both read from a config, and where a rank sits on the device mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_npu.config.schema import Float8Config, JobConfig
from titan_npu.errors import LayoutError
from titan_npu.models.registry import build_model_args
from titan_npu.parallel import arithmetic

GiB = 1024**3
MiB = 1024**2
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
AC_MODES = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class Layout:
    """How one job is laid out: parallel degrees, activation checkpointing and the batch split per rank."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (a factor of the world size)
    ep: int = 1  # expert parallel: the experts split over ep of the dp_shard ranks (not a factor of the world size)
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 1  # hybrid: the cp ranks of one Ulysses group (parallel.cp_ulysses_degree), the ring between
    fsdp: bool = True
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

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "batch_size", "grad_accum",
                     "selective_every"):
            if getattr(self, name) < 1:
                raise LayoutError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.ac not in AC_MODES:
            raise LayoutError(f"activation_checkpoint.mode={self.ac!r} is unknown (choose {', '.join(AC_MODES)})")
        if self.cp_mode not in CP_MODES:
            raise LayoutError(f"parallel.cp_mode={self.cp_mode!r} is unknown (choose {', '.join(CP_MODES)})")
        hybrid = self.cp_mode == "hybrid" and self.cp > 1
        if hybrid and (self.cp % self.cp_ulysses or not 1 < self.cp_ulysses < self.cp):
            raise LayoutError(f"parallel.cp_ulysses_degree={self.cp_ulysses} must divide cp_degree={self.cp} and lie "
                              f"between 1 and it (hybrid: Ulysses within its groups, the ring between them)")
        if not hybrid and self.cp_ulysses != 1:
            raise LayoutError(f"layout cp_ulysses={self.cp_ulysses} needs cp_mode 'hybrid' with cp > 1")
        if self.fsdp_shards % self.ep:
            raise LayoutError(f"parallel.ep_degree={self.ep} must divide dp_shard x cp = {self.fsdp_shards} (the ep "
                              f"ranks are taken from the FSDP ranks); choose ep_degree from "
                              f"{arithmetic.divisors(self.fsdp_shards)}")
        if self.pp > 1 and self.local_batch % self.n_microbatches:
            raise LayoutError(
                f"{self.local_batch} sequences per pipeline step (batch_size x gradient_accumulation_steps) do not "
                f"split into {self.n_microbatches} micro-batches; make them a multiple of parallel.pp_microbatches"
            )

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP splits a (dense) parameter over: dp_shard, times cp (the cp ranks shard parameters too)."""
        return self.dp_shard * self.cp

    @property
    def shards_parameters(self) -> bool:
        """FSDP splits parameters, gradients and optimizer state over dp_shard (x cp)."""
        return self.fsdp and self.fsdp_shards > 1

    @property
    def efsdp(self) -> int:
        """The dp_shard x cp / ep FSDP ranks that hold an expert-parallel rank's experts (the same ones)."""
        return self.fsdp_shards // self.ep

    @property
    def expert_shards(self) -> int:
        """Ranks FSDP splits an expert-parallel rank's experts over (parallel/dims.py's experts_fsdp_mesh): the efsdp
        ranks, or under HSDP with ep = dp_shard x cp the dp_replicate ranks (the replicas of one ep group); 1 when
        none do (the experts then stay whole on their ep rank)."""
        if not self.fsdp:
            return 1
        return self.efsdp if self.efsdp > 1 else self.dp_replicate

    @property
    def fsdp_wrapped(self) -> bool:
        """FSDP2 (fully_shard or replicate) holds the parameters: it casts them, so no autocast weight copies."""
        return self.dp * self.cp > 1

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the loss's output projection; 0 = whole logits (always so under TP or PP, as the
        trainer does: titan_npu/ops/cross_entropy.py)."""
        return self.loss_chunk_tokens if self.tp == 1 and self.pp == 1 else 0

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

    def degrees(self) -> dict[str, int]:
        """Size of each mesh dimension (cp only when context parallel, as the trainer's mesh has it)."""
        cp = {"cp": self.cp} if self.cp > 1 else {}
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, **cp, "tp": self.tp}

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


@dataclass(frozen=True)
class Job:
    """What the estimate needs from the config besides the layout."""

    args: Any  # the model's args (models/spec.py)
    seq_len: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    momentum: float = 0.9  # SGD keeps a momentum buffer only when this is non-zero
    float8: Float8Config | None = None  # float8 matmuls (float8.enable); None = off

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def job_from_config(cfg: JobConfig) -> Job:
    """The model and training settings of a config, resolved."""
    return Job(
        args=build_model_args(cfg.model),
        seq_len=cfg.training.seq_len,
        dtype=cfg.training.dtype,
        optimizer=cfg.optimizer.name.lower(),
        momentum=float(cfg.optimizer.betas[0]) if cfg.optimizer.betas else 0.0,
        float8=cfg.float8 if cfg.float8.enable else None,
    )


def layout_from_config(cfg: JobConfig, world_size: int) -> Layout:
    """The config's layout on `world_size` ranks (dp_shard = -1 resolved the way ParallelDims does)."""
    from titan_npu.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    p, ac = cfg.parallel, cfg.activation_checkpoint
    return Layout(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        cp=dims.cp,
        ep=dims.ep,
        cp_mode=p.cp_mode,
        cp_ulysses=dims.cp_ulysses,
        fsdp=p.fsdp,
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
    )



def rank_coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """A rank's index along each mesh dimension (pp, dp_replicate, dp_shard, [cp,] tp), as init_device_mesh lays it
    out."""
    if not 0 <= rank < layout.world_size:
        raise LayoutError(f"rank {rank} is outside a {layout.world_size}-rank job (choose 0..{layout.world_size - 1})")
    return arithmetic.mesh_coordinates(layout.degrees(), rank)


def coordinates_rank(layout: Layout, coords: dict[str, int]) -> int:
    """The rank at the given mesh coordinates (the inverse of rank_coordinates)."""
    return arithmetic.mesh_rank(layout.degrees(), coords)


def fsdp_index(layout: Layout, coords: dict[str, int]) -> int:
    """A rank's index among the ranks FSDP shards a dense parameter over (dp_shard x cp flattened, cp innermost)."""
    return coords["dp_shard"] * layout.cp + coords.get("cp", 0)

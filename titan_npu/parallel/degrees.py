"""Degrees: the parallel degrees of a job, what follows from them and the rules they obey, free of torch.

The trainer's ParallelDims (parallel/dims.py) is a Degrees plus the device meshes built from it, and the planner's
Layout (planner/layout.py) is a Degrees plus checkpointing and the batch split: both resolve a config's [parallel]
section here, so a degree, a derived size and a layout rule exist once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_npu.errors import LayoutError
from titan_npu.intmath import divisor_hint
from titan_npu.parallel.arithmetic import mesh_coordinates, mesh_rank

if TYPE_CHECKING:
    from titan_npu.config.schema import ParallelConfig

CP_MODES = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class Degrees:
    """Ranks along each parallel dimension; their product (ep aside) is the world size.

    Mesh: pp, dp_replicate, dp_shard, [cp,] tp, outermost first. ep is borrowed from the FSDP ranks (dp_shard x cp),
    not a factor of the world size; cp_ulysses is the cp ranks of one Ulysses group under hybrid context parallelism
    (1: not hybrid).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid (parallel.cp_mode)
    cp_ulysses: int = 1
    fsdp: bool = True  # data-parallel ranks shard the model (false: replicate it)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel degree {name}={getattr(self, name)} must be >= 1")
        if self.cp_mode not in CP_MODES:
            raise LayoutError(f"parallel.cp_mode={self.cp_mode!r} is unknown (choose {', '.join(CP_MODES)})")
        if not self.fsdp and self.dp_shard > 1 and self.dp_replicate > 1:
            raise LayoutError(
                f"parallel.fsdp=false with dp_shard={self.dp_shard} and dp_replicate={self.dp_replicate} is "
                "ambiguous; with fsdp=false use dp_replicate only (or dp_shard with dp_replicate=1)"
            )
        if self.fsdp_shards % self.ep:
            ranks = (f"dp_shard={self.dp_shard}" if self.cp == 1
                     else f"dp_shard x cp_degree = {self.dp_shard} x {self.cp} = {self.fsdp_shards}")
            raise LayoutError(f"parallel.ep_degree={self.ep} must divide {ranks} (the expert-parallel ranks "
                              f"are taken from the FSDP ranks); choose ep_degree from {divisor_hint(self.fsdp_shards)}")
        if self.hybrid_cp and (self.cp % self.cp_ulysses or not 1 < self.cp_ulysses < self.cp):
            choices = [d for d in divisor_hint(self.cp) if 1 < d < self.cp]
            raise LayoutError(
                f"parallel.cp_ulysses_degree={self.cp_ulysses}: hybrid context parallelism runs Ulysses within groups "
                f"of cp_ulysses_degree ranks and the ring between them, so it must divide cp_degree={self.cp} and lie "
                f"strictly between 1 and it; "
                + (f"choose it from {choices}" if choices else "use parallel.cp_mode = \"ring\" or \"ulysses\"")
            )
        if not self.hybrid_cp and self.cp_ulysses != 1:
            raise LayoutError(f"cp_ulysses={self.cp_ulysses} needs parallel.cp_mode = \"hybrid\" with cp_degree > 1")

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> Degrees:
        """The degrees of [parallel] on `world_size` ranks: dp_shard = -1 takes the remaining ranks, and the product
        must be the world size (one process may smoke-test a data-parallel config: it trains on 1 and warns)."""
        for name in ("dp_replicate", "tp_degree", "pp_degree", "cp_degree"):
            if getattr(cfg, name) < 1:
                raise LayoutError(f"parallel.{name}={getattr(cfg, name)} must be >= 1")
        cp = cfg.cp_degree
        fixed = cfg.dp_replicate * cfg.tp_degree * cfg.pp_degree * cp
        cp_term = "*cp_degree" if cp > 1 else ""
        cp_value = f"*{cp}" if cp > 1 else ""
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not divisible by dp_replicate*tp_degree*pp_degree{cp_term} = "
                    f"{cfg.dp_replicate}*{cfg.tp_degree}*{cfg.pp_degree}{cp_value} = {fixed}; "
                    f"choose degrees whose product divides {world_size} (divisors: {divisor_hint(world_size)})"
                )
            dp_shard = world_size // fixed
        if dp_shard < 1:
            raise LayoutError(f"parallel.dp_shard={dp_shard} must be -1 (all remaining ranks) or >= 1")
        product = fixed * dp_shard
        if product != world_size and world_size == 1 and cfg.tp_degree == cfg.pp_degree == cp == 1:
            # A single process asked for data parallelism only: a smoke test of a cluster config. Every rank would
            # run the same per-rank math, so train on one and say how the global batch differs.
            logging.getLogger("titan_npu").warning(
                "parallel: the config asks for %d data-parallel ranks but this is a single process; training on 1 "
                "(global batch %dx smaller). Launch `torchrun --nproc_per_node %d ...` for the configured layout.",
                product, product, product,
            )
            return cls(fsdp=cfg.fsdp, cp_mode=cfg.cp_mode)
        if product != world_size:
            raise LayoutError(
                f"parallel degrees multiply to {product} (dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x "
                f"tp={cfg.tp_degree} x pp={cfg.pp_degree}{f' x cp={cp}' if cp > 1 else ''}) but the world size is "
                f"{world_size}; "
                f"set parallel.dp_shard = -1 to use the remaining ranks, or launch {product} processes"
            )
        cp_ulysses = cfg.cp_ulysses_degree if cfg.cp_mode == "hybrid" and cp > 1 else 1
        return cls(cfg.dp_replicate, dp_shard, cfg.tp_degree, cfg.pp_degree, cp, cfg.ep_degree, cfg.cp_mode,
                   cp_ulysses, cfg.fsdp)

    # --- sizes ------------------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP splits a (dense) parameter over: dp_shard, times cp (the cp ranks shard parameters too)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The dp_shard x cp / ep FSDP ranks that hold an expert-parallel rank's experts (the same ones)."""
        return self.fsdp_shards // self.ep

    @property
    def expert_shards(self) -> int:
        """Ranks FSDP splits an expert-parallel rank's experts over (ParallelDims.expert_dp_mesh): the efsdp ranks,
        or under HSDP with ep = dp_shard x cp the dp_replicate ranks (the replicas of one ep group); 1 when none do
        (the experts then stay whole on their ep rank)."""
        if not self.fsdp:
            return 1
        return self.efsdp if self.efsdp > 1 else self.dp_replicate

    # --- what is on -------------------------------------------------------------------------------------------------

    @property
    def dp_enabled(self) -> bool:
        """Whether a data-parallel wrapper (FSDP / replicate) holds the model: several data-parallel ranks, or
        context-parallel ones (which shard the parameters too); it then casts the parameters itself."""
        return self.dp * self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP splits parameters, gradients and optimizer state over dp_shard (x cp)."""
        return self.fsdp and self.fsdp_shards > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def hybrid_cp(self) -> bool:
        """Context parallelism with Ulysses inside groups of cp_ulysses ranks and the ring between them."""
        return self.cp_mode == "hybrid" and self.cp > 1

    @property
    def dp_mode(self) -> str:
        """How the data-parallel ranks hold the model: 'fsdp', 'hsdp', 'replicate' (fsdp=false) or 'none'."""
        if self.dp * self.cp == 1:
            return "none"
        if not self.fsdp:
            return "replicate"
        return "hsdp" if self.dp_replicate > 1 else "fsdp"

    @property
    def params_are_sharded(self) -> bool:
        """Whether parameters become DTensors (FSDP, replicate or TP): the fp16 grad scaler must then be sharded."""
        return self.dp_mode != "none" or self.tp_enabled

    def loss_chunk_tokens(self, chunk_tokens: int) -> int:
        """Tokens per chunk of the loss's output projection (training.loss_chunk_tokens), or 0 (whole logits) under
        tensor or pipeline parallelism, where the model's forward does not hold the whole output projection."""
        return chunk_tokens if self.tp == 1 and self.pp == 1 else 0

    # --- the mesh ---------------------------------------------------------------------------------------------------

    def mesh_shape(self) -> dict[str, int]:
        """Size of each mesh dimension, outermost first (cp only when context parallel, as the mesh has it)."""
        cp = {"cp": self.cp} if self.cp > 1 else {}
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, **cp, "tp": self.tp}

    def rank_coordinates(self, rank: int) -> dict[str, int]:
        """A rank's index along each mesh dimension, as init_device_mesh lays the ranks out."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a {self.world_size}-rank job (choose 0..{self.world_size - 1})")
        return mesh_coordinates(self.mesh_shape(), rank)

    def coordinates_rank(self, coords: Mapping[str, int]) -> int:
        """The rank at the given mesh coordinates (missing ones 0): the inverse of rank_coordinates."""
        return mesh_rank(self.mesh_shape(), coords)

    def fsdp_index(self, coords: Mapping[str, int]) -> int:
        """A rank's index among the ranks FSDP shards a dense parameter over (dp_shard x cp flattened, cp
        innermost)."""
        return coords["dp_shard"] * self.cp + coords.get("cp", 0)

    def describe(self) -> str:
        """One line for the start-up log."""
        kind = {"fsdp": "FSDP", "hsdp": "HSDP", "replicate": "DP (replicated)", "none": "no DP"}[self.dp_mode]
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        if self.cp_ulysses > 1:
            cp += f" (ulysses {self.cp_ulysses} x ring {self.cp // self.cp_ulysses})"
        return (f"world={self.world_size} pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
                f"tp={self.tp}{cp}{f' ep={self.ep}' if self.ep > 1 else ''} ({kind})")

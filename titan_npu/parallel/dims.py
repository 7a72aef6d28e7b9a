"""ParallelDims: the one place that knows the parallel degrees, validates them and builds the device mesh."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_npu.config.schema import ParallelConfig
from titan_npu.errors import LayoutError
from titan_npu.parallel.arithmetic import MESH_DIMS, divisors
from titan_npu.parallel.process_group import set_collective_timeout

# With context parallelism the cp ranks sit between dp_shard and tp (MESH_DIMS' order otherwise; their ring traffic
# is heavier than FSDP's, lighter than TP's); FSDP shards parameters over dp_shard x cp flattened ("dp_shard_cp"),
# as torchtitan does.
CP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size (mesh: pp, dp_replicate, dp_shard,
    [cp,] tp)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    fsdp: bool = True
    cp: int = 1
    ep: int = 1  # expert parallel: borrowed from dp_shard x cp (not a factor of the world size)
    cp_ulysses: int = 1  # hybrid context parallel: the cp ranks of one Ulysses group (1: not hybrid)
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _hybrid_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 to the remaining ranks and check that the product is the world size."""
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
                    f"choose degrees whose product divides {world_size} (divisors: {divisors(world_size)})"
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
            return cls(1, 1, 1, 1, 1, cfg.fsdp)
        if product != world_size:
            raise LayoutError(
                f"parallel degrees multiply to {product} (dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x "
                f"tp={cfg.tp_degree} x pp={cfg.pp_degree}{f' x cp={cp}' if cp > 1 else ''}) but the world size is "
                f"{world_size}; "
                f"set parallel.dp_shard = -1 to use the remaining ranks, or launch {product} processes"
            )
        if not cfg.fsdp and dp_shard > 1 and cfg.dp_replicate > 1:
            raise LayoutError(
                f"parallel.fsdp=false with dp_shard={dp_shard} and dp_replicate={cfg.dp_replicate} is ambiguous; "
                "with fsdp=false use dp_replicate only (or dp_shard with dp_replicate=1)"
            )
        ep, shard = cfg.ep_degree, dp_shard * cp  # FSDP's ranks: dp_shard x cp
        if ep < 1 or shard % ep:
            ranks = f"dp_shard={dp_shard}" if cp == 1 else f"dp_shard x cp_degree = {dp_shard} x {cp} = {shard}"
            raise LayoutError(f"parallel.ep_degree={ep} must divide {ranks} (the expert-parallel ranks "
                              f"are taken from the FSDP ranks); choose ep_degree from {divisors(shard)}")
        cp_ulysses = 1
        if cfg.cp_mode == "hybrid" and cp > 1:
            cp_ulysses = cfg.cp_ulysses_degree
            if cp % cp_ulysses or not 1 < cp_ulysses < cp:
                choices = [d for d in divisors(cp) if 1 < d < cp]
                raise LayoutError(
                    f"parallel.cp_ulysses_degree={cp_ulysses}: hybrid context parallelism runs Ulysses within groups "
                    f"of cp_ulysses_degree ranks and the ring between them, so it must divide cp_degree={cp} and lie "
                    f"strictly between 1 and it; "
                    + (f"choose it from {choices}" if choices else "use parallel.cp_mode = \"ring\" or \"ulysses\"")
                )
        return cls(cfg.dp_replicate, dp_shard, cfg.tp_degree, cfg.pp_degree, world_size, cfg.fsdp, cp, ep, cp_ulysses)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        """Whether a data-parallel wrapper (FSDP / replicate) holds the model: several data-parallel ranks, or
        context-parallel ones (which shard the parameters too)."""
        return self.dp * self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp and self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks one MoE layer's experts are split over: ep consecutive FSDP ranks (dp_shard, or dp_shard x cp
        flattened under context parallelism; all of them when ep_degree is their number)."""
        if self._expert_mesh is not None:
            return self._expert_mesh["ep"]
        return self.mesh["dp_shard_cp" if self.cp_enabled else "dp_shard"]

    @property
    def ep_tp_mesh(self) -> DeviceMesh:
        """The ep x tp ranks of one expert-parallel group (expert parallelism with tensor parallelism): the experts
        are split over ep on their expert dim and over tp on their ffn dim."""
        return self.mesh["dp_shard", "tp"] if self._expert_mesh is None else self._expert_mesh["ep", "tp"]

    @property
    def efsdp_mesh(self) -> DeviceMesh | None:
        """The dp_shard / ep ranks that hold the same experts and shard them with FSDP; None when ep = dp_shard."""
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return None if self._expert_mesh is None else self._expert_mesh["efsdp"]

    @property
    def expert_dp_mesh(self) -> DeviceMesh | None:
        """The ranks that hold the same experts and shard them with FSDP: the efsdp ranks, or under HSDP with
        ep_degree = dp_shard the dp_replicate ranks (the replicas of one ep group); None when no two ranks do."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate"]
        return self.efsdp_mesh

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

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

    def build_mesh(self, device_type: str, collective_timeout_s: float | None = None) -> DeviceMesh:
        """Build (once) the world mesh with named dims and the flattened 'dp' view.

        collective_timeout_s, when given, is applied to every group of the mesh (gloo, nccl and hccl).
        """
        if self._mesh is not None:
            return self._mesh
        if self.cp_enabled:
            names, sizes = CP_MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        else:
            names, sizes = MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        flat = ("dp",)
        if self.cp_enabled:
            mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
            mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
            flat = ("dp", "dp_shard_cp", "dp_cp")
        if collective_timeout_s:
            for name in (*names, *flat):
                set_collective_timeout(mesh[name].get_group(), collective_timeout_s)
        if self.cp_ulysses > 1:
            # Hybrid context parallel: cp split into (ring, Ulysses), a Ulysses group of adjacent cp ranks.
            sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp // self.cp_ulysses, self.cp_ulysses, self.tp)
            self._hybrid_mesh = DeviceMesh(device_type, mesh.mesh.reshape(sizes), mesh_dim_names=(
                "pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp"))
            if collective_timeout_s:
                for name in ("cp_ring", "cp_ulysses"):
                    set_collective_timeout(self._hybrid_mesh[name].get_group(), collective_timeout_s)
        if 1 < self.ep < self.dp_shard * self.cp:
            # The experts' own mesh: the FSDP ranks (dp_shard x cp) split into (efsdp, ep), consecutive ones forming an
            # ep group.
            sizes = (self.pp, self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, self.tp)
            self._expert_mesh = DeviceMesh(device_type, mesh.mesh.reshape(sizes),
                                           mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
            if collective_timeout_s:
                for name in ("efsdp", "ep"):
                    set_collective_timeout(self._expert_mesh[name].get_group(), collective_timeout_s)
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP / replicate works on: 2-D (dp_replicate, dp_shard) for HSDP, else 1-D; with context
        parallelism dp_shard x cp flattened takes dp_shard's place."""
        mode = self.dp_mode
        shard = "dp_shard_cp" if self.cp_enabled else "dp_shard"
        if mode == "hsdp":
            return self.mesh["dp_replicate", shard]
        if mode == "replicate":
            return self.mesh["dp"]
        return self.mesh[shard]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def token_mesh(self) -> DeviceMesh:
        """The ranks that hold different tokens of a step (data-parallel x context-parallel): a sum over the
        step's tokens reduces over this mesh."""
        return self.mesh["dp_cp"] if self.cp_enabled else self.mesh["dp"]

    def hybrid_cp_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(Ulysses group, ring group) of this rank under hybrid context parallelism: its cp_ulysses adjacent cp
        ranks, and the cp ranks of the same place in every Ulysses group, in group order."""
        if self._hybrid_mesh is None:
            raise RuntimeError("hybrid context parallelism needs parallel.cp_mode = \"hybrid\" and build_mesh()")
        return self._hybrid_mesh["cp_ulysses"].get_group(), self._hybrid_mesh["cp_ring"].get_group()

    def cp_coordinates(self) -> tuple[int, int]:
        """(cp_rank, cp_degree) of this rank: which chunks of each sequence it holds."""
        if self.cp == 1:
            return 0, 1
        return self.cp_mesh.get_local_rank(), self.cp

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    def pp_coordinates(self) -> tuple[int, int]:
        """(pp_rank, pp_degree) of this rank: which pipeline stage(s) it runs."""
        if self.pp == 1:
            return 0, 1
        return self.pp_mesh.get_local_rank(), self.pp

    def dp_coordinates(self) -> tuple[int, int]:
        """(dp_rank, dp_degree) of this rank: which slice of the data it reads."""
        if self.world_size == 1:
            return 0, 1
        dp_mesh = self.mesh["dp"]
        return dp_mesh.get_local_rank(), dp_mesh.size()

    def describe(self) -> str:
        """One line for the start-up log."""
        kind = {"fsdp": "FSDP", "hsdp": "HSDP", "replicate": "DP (replicated)", "none": "no DP"}[self.dp_mode]
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        if self.cp_ulysses > 1:
            cp += f" (ulysses {self.cp_ulysses} x ring {self.cp // self.cp_ulysses})"
        return (f"world={self.world_size} pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
                f"tp={self.tp}{cp}{f' ep={self.ep}' if self.ep > 1 else ''} ({kind})")


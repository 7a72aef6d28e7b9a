"""ParallelDims: a job's parallel degrees (parallel/degrees.py) and the device meshes built from them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_npu.parallel.degrees import Degrees
from titan_npu.parallel.process_group import set_collective_timeout

if TYPE_CHECKING:
    from titan_npu.config.schema import ParallelConfig

# With context parallelism the cp ranks sit between dp_shard and tp (arithmetic.CP_MESH_DIMS; their ring traffic is
# heavier than FSDP's, lighter than TP's); FSDP shards parameters over dp_shard x cp flattened ("dp_shard_cp"), as
# torchtitan does.


class ParallelDims:
    """A job's Degrees and the device meshes built from them (mesh: pp, dp_replicate, dp_shard, [cp,] tp).

    The degrees, their derived sizes and rules are the Degrees' (dims.tp, dims.dp_mode, dims.describe() read
    through to it); this class adds what needs torch.distributed: the meshes and a rank's place on them.
    """

    def __init__(self, degrees: Degrees) -> None:
        self.degrees = degrees
        self._mesh: DeviceMesh | None = None
        self._expert_mesh: DeviceMesh | None = None
        self._hybrid_mesh: DeviceMesh | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "degrees":  # not yet set (a copy being built): no degrees to read through to
            raise AttributeError(name)
        return getattr(self.degrees, name)

    def __repr__(self) -> str:
        return f"ParallelDims({self.degrees!r})"

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """The degrees of [parallel] on `world_size` ranks (Degrees.from_config), meshes not yet built."""
        return cls(Degrees.from_config(cfg, world_size))

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





    def build_mesh(self, device_type: str, collective_timeout_s: float | None = None) -> DeviceMesh:
        """Build (once) the world mesh with named dims and the flattened 'dp' view.

        collective_timeout_s, when given, is applied to every group of the mesh (gloo, nccl and hccl).
        """
        if self._mesh is not None:
            return self._mesh
        shape = self.degrees.mesh_shape()
        names = tuple(shape)
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=names)
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

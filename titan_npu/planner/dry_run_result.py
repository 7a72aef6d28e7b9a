"""What a dry run measured on one rank (planner/dry_run.py measures it, planner/verify.py compares it with the
planner's numbers): the one value both share, so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3


@dataclass
class DryRunResult:
    """What one rank of the job holds, measured on the parallelized model."""

    world_size: int
    rank: int
    layout: str
    coordinates: dict[str, int]
    parameters: dict[str, dict] = field(default_factory=dict)  # name -> global/local shape, dtype, placements
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_bytes: int = 0
    optimizer: str = ""
    optimizer_gather_bytes: int = 0  # Muon: bytes gathered per step to orthogonalise whole matrices
    forward_checked: bool = False
    output_shape: tuple[int, ...] | None = None
    seconds: float = 0.0
    uncompiled: bool = False  # compile.enable was on: the model was built and run without torch.compile

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size, "rank": self.rank, "layout": self.layout,
            "coordinates": self.coordinates, "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes, "optimizer_bytes": self.optimizer_bytes,
            "optimizer": self.optimizer, "optimizer_gather_bytes": self.optimizer_gather_bytes,
            "forward_checked": self.forward_checked,
            "output_shape": list(self.output_shape) if self.output_shape else None,
            "n_parameters": len(self.parameters), "seconds": round(self.seconds, 2), "uncompiled": self.uncompiled,
            "parameters": self.parameters,
        }

    def format(self) -> str:
        """A short report: where the rank sits, what it holds, whether forward/backward ran."""
        coords = " ".join(f"{k}={v}" for k, v in self.coordinates.items())
        fwd = (f"forward/backward checked (output {list(self.output_shape)})" if self.forward_checked
               else "forward/backward not run")
        lines = [
            f"dry run: rank {self.rank} of {self.world_size} ({coords}); layout {self.layout}",
            f"  parameters  {_size(self.parameter_bytes):>10} in {len(self.parameters)} local shards",
            f"  gradients   {_size(self.gradient_bytes):>10}",
            f"  optimizer   {_size(self.optimizer_bytes):>10} ({self.optimizer})",
            *([f"  optimizer gathers {_size(self.optimizer_gather_bytes)} per step (Muon's whole matrices)"]
              if self.optimizer_gather_bytes else []),
            f"  {fwd}; {self.seconds:.1f}s",
        ]
        if self.uncompiled:
            lines.append("  compile.enable is on: the dry run builds and runs the model uncompiled (compiled graphs "
                         "cannot run on fake tensors); compile changes no shard or byte count")
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"

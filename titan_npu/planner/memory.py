"""estimate_memory: a rank's peak device memory, from its state, activations, temporaries and buffers."""

from __future__ import annotations

from dataclasses import dataclass

from titan_npu.planner.activations import rank_activations
from titan_npu.planner.communication import RUNTIME_RESERVE_BYTES, communication_bytes
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.parameters import state_bytes
from titan_npu.planner.temporaries import temporary_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-rank device memory of a layout, in bytes."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    communication: int
    runtime: int
    rank: int
    pp_rank: int
    host_offload: int = 0  # bytes cpu_offload keeps in host memory instead
    host_activations: int = 0  # bytes of saved activations activation offload keeps in host memory at the peak

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.temporary
                + self.communication + self.runtime)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
            "activations": self.activations, "temporary": self.temporary, "communication": self.communication,
            "runtime": self.runtime, "total": self.total, "rank": self.rank, "pp_rank": self.pp_rank,
            "host_offload": self.host_offload, "host_activations": self.host_activations,
        }


def estimate_memory(job: Job, layout: Layout, device_type: str = "cpu", hccl_buffsize_mb: int = 0,
                    rank: int | None = None) -> MemoryBreakdown:
    """Peak device memory of `rank` (default: the rank with the largest peak among the pipeline ranks).

    Peak = state (parameters, gradients, optimizer) + max(activations + backward temporaries, optimizer-step
    temporaries) + collective buffers + runtime reserve. Gradients are counted whole: they exist at the peak
    whenever a step runs more than one forward/backward, and a plan must survive that case.
    """
    if rank is not None:
        candidates = [rank]
    else:
        # Coordinate 0 on every other dim holds the largest tp and FSDP chunks of its pipeline rank.
        candidates = [layout.coordinates_rank({"pp": r}) for r in range(layout.pp)]
    best: MemoryBreakdown | None = None
    for r in candidates:
        pp_rank = layout.rank_coordinates(r)["pp"]
        state = state_bytes(job, layout, r)
        acts = rank_activations(job, layout, pp_rank, device_type)
        # The optimizer step's intermediates are sized by what it updates (the trained parameters: LoRA's adapters).
        temp = temporary_bytes(job, layout, pp_rank, acts.extra, device_type, state.gradients)
        during = max(temp.during_backward, temp.optimizer_step - acts.saved)
        offload = layout.cpu_offload
        breakdown = MemoryBreakdown(
            parameters=0 if offload else state.parameters,
            gradients=0 if offload else state.gradients,
            optimizer=0 if offload else state.optimizer,
            activations=acts.saved,
            temporary=during,
            communication=communication_bytes(layout, device_type, hccl_buffsize_mb),
            runtime=RUNTIME_RESERVE_BYTES.get(device_type, 0),
            rank=r,
            pp_rank=pp_rank,
            host_offload=state.parameters + state.gradients + state.optimizer if offload else 0,
            host_activations=acts.offloaded if device_type != "cpu" else 0,
        )
        if best is None or breakdown.total > best.total:
            best = breakdown
    assert best is not None
    return best

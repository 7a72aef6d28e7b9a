"""The pipeline stages a rank runs, cut as the trainer cuts them (the family's split_layers with the schedule's
leftover order, looped or V placement)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from titan_npu.models.registry import spec_of
from titan_npu.parallel.arithmetic import leftover_stages, stage_ids_for_rank
from titan_npu.planner.layout import Layout

# Parameters outside the blocks, in the model's order (a pipeline stage holds those of its end of the model).
FIRST_STAGE_KINDS = ("tok_embeddings.weight",)
LAST_STAGE_KINDS = ("norm.weight", "output.weight")


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage a rank runs: its blocks and whether it holds the embedding / the norm and output."""

    stage: int
    layers: tuple[int, ...]
    first: bool
    last: bool

    def root_kinds(self, kinds: Collection[str]) -> list[str]:
        """The parameters outside the blocks this stage holds, of those the model has (`kinds`: a tied model
        has no output.weight of its own)."""
        held = (FIRST_STAGE_KINDS if self.first else ()) + (LAST_STAGE_KINDS if self.last else ())
        return [k for k in held if k in kinds]



def rank_parts(args: Any, layout: Layout, pp_rank: int) -> list[StagePart]:
    """The stages pipeline rank `pp_rank` runs (looped: pp_rank, pp_rank + pp, ...; V: pp_rank, 2 pp - 1 - pp_rank),
    cut as the trainer cuts them."""
    return list(_rank_parts(spec_of(args).split_layers, args.n_layers, layout.pp, layout.stages_per_rank, pp_rank,
                            layout.pp_schedule))


@lru_cache(maxsize=4096)
def _rank_parts(split_layers: Callable[..., list[list[int]]], n_layers: int, pp: int, stages_per_rank: int,
                pp_rank: int, pp_schedule: str = "1F1B") -> tuple[StagePart, ...]:
    """rank_parts from everything it depends on (a search asks for the same few splits thousands of times)."""
    if pp == 1:
        return (StagePart(0, tuple(range(n_layers)), True, True),)
    n_stages = pp * stages_per_rank
    layers = split_layers(n_layers, n_stages, leftover_stages(n_stages, pp_schedule))
    ids = stage_ids_for_rank(pp_rank, pp, stages_per_rank, pp_schedule)
    return tuple(StagePart(i, tuple(layers[i]), i == 0, i == n_stages - 1) for i in ids)

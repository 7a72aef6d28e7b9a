"""Pipeline split of a dense decoder: which layers each stage holds, and the stage module itself."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from titan_npu.errors import LayoutError
from titan_npu.parallel.arithmetic import leftover_stages


def split_layers(n_layers: int, n_stages: int, leftovers: Sequence[int] | None = None) -> list[list[int]]:
    """Layer ids of each stage: an even split; the leftover layers go one each to the stages of `leftovers` in its
    order (default: parallel.arithmetic.leftover_stages, the middle stages first, because the first stage also holds
    the embedding and the last the output projection and loss, so they may take fewer)."""
    if n_stages < 1 or n_layers < n_stages:
        raise LayoutError(
            f"cannot split {n_layers} layers into {n_stages} pipeline stages; every stage needs at least one layer "
            f"(use at most {n_layers} stages)"
        )
    counts = [n_layers // n_stages] * n_stages
    order = leftover_stages(n_stages) if leftovers is None else leftovers
    for stage in order[: n_layers % n_stages]:
        counts[stage] += 1
    ids, start = [], 0
    for count in counts:
        ids.append(list(range(start, start + count)))
        start += count
    return ids


def build_stage(model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool) -> nn.Module:
    """A copy of `model` (on the meta device: no memory) holding only `layer_ids`, the embedding if first and the
    final norm and output if last; layer names stay global ("layers.7..."), so checkpoints map one to one."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    return stage

"""Labels masked as supervised fine-tuning masks them (-100 outside the answers), for the masked-loss tests.

Imported as `masked_labels` (tests/ is on sys.path, as for tiny_run). The mask is a function of each sequence's own
tokens, so every layout (whichever rank reads a sequence, in whichever micro-batch) masks the same labels.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_npu.ops.cross_entropy import IGNORE_INDEX


def mask_labels(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`labels` [B, S] with about 70% of them -100; of a sequence whose first token is 2 mod 4 every label but the
    last two, of one whose first token is 0 mod 4 every label: micro-batches of very different valid counts, some
    with no valid label at all (or none in a context-parallel rank's chunks)."""
    positions = torch.arange(labels.shape[1])
    keep = (inputs * 7 + labels * 13 + positions * 5) % 10 < 3
    sparse = inputs[:, 0] % 2 == 0
    keep[sparse] = False
    keep[inputs[:, 0] % 4 == 2, -2:] = True
    return labels.masked_fill(~keep, IGNORE_INDEX)


class MaskedLoader:
    """A trainer's data loader whose batches' labels are masked by mask_labels (the test's data hook); the batches
    handed out are kept in `batches`. Everything else is the loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.batches: list[tuple[torch.Tensor, ...]] = []

    def __iter__(self):
        for inputs, labels, *rest in self.loader:
            batch = (inputs, mask_labels(inputs, labels), *rest)
            self.batches.append(batch)
            yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

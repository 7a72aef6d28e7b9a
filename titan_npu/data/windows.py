"""Documents packed into windows of seq_len + 1 tokens (the unit every loader hands out), and a refusal met in a
loader worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from titan_npu.data.datasets import TokenDataset
from titan_npu.errors import DataError
from titan_npu.ops.documents import Documents
from titan_npu.reliability.preemption import leave_signals_to_parent


class PackedWindows:
    """The documents doc_ids of a dataset, concatenated, cut into windows of seq_len + 1 tokens (one overlaps)."""

    def __init__(self, dataset: TokenDataset, doc_ids: np.ndarray, seq_len: int):
        self.dataset = dataset
        self.doc_ids = doc_ids
        self.seq_len = seq_len
        self.lengths = dataset.doc_lengths[doc_ids]
        self.ends = np.cumsum(self.lengths)
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)

    def window(self, w: int) -> np.ndarray:
        """Tokens [w * seq_len, w * seq_len + seq_len + 1) of the packed stream."""
        start, stop = w * self.seq_len, w * self.seq_len + self.seq_len + 1
        i = int(np.searchsorted(self.ends, start, side="right"))
        pieces, pos = [], start
        while pos < stop:
            doc_start = int(self.ends[i] - self.lengths[i])
            hi = min(int(self.ends[i]), stop)
            pieces.append(self.dataset.read(int(self.doc_ids[i]), pos - doc_start, hi - doc_start))
            pos, i = hi, i + 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.asarray(pieces[0])

    def first_over(self, w: int, limit: int) -> tuple[str, int]:
        """(file, id) of the first document piece in window w holding an id >= limit, for messages."""
        start, stop = w * self.seq_len, w * self.seq_len + self.seq_len + 1
        i = int(np.searchsorted(self.ends, start, side="right"))
        pos = start
        while pos < stop and i < len(self.ends):
            doc_start = int(self.ends[i] - self.lengths[i])
            hi = min(int(self.ends[i]), stop)
            piece = self.dataset.read(int(self.doc_ids[i]), pos - doc_start, hi - doc_start)
            if len(piece) and int(piece.max()) >= limit:
                return self.dataset.where(int(self.doc_ids[i])), int(piece.max())
            pos, i = hi, i + 1
        return self.dataset.description, limit

    def doc_starts(self, w: int) -> np.ndarray:
        """Offsets inside window w where a document begins (for document masking)."""
        start, stop = w * self.seq_len, w * self.seq_len + self.seq_len + 1
        begins = self.ends - self.lengths
        lo, hi = np.searchsorted(begins, [start, stop])
        return (begins[lo:hi] - start).astype(np.int64)


def batch_of(picks: list[tuple[PackedWindows, int]], vocab_limit: int | None, documents: str) -> tuple:
    """(inputs, labels[, Documents]) of the windows `picks` ((its packed stream, window index) each); a DataError
    naming the file when a token id is at or over `vocab_limit` (an id the index did not show)."""
    rows = np.stack([packed.window(w) for packed, w in picks])
    if vocab_limit is not None and rows.size and int(rows.max()) >= vocab_limit:
        packed, w = next(pick for pick, row in zip(picks, rows) if int(row.max()) >= vocab_limit)
        where, top = packed.first_over(w, vocab_limit)
        raise DataError(f"{where} holds token id {top} but model.vocab_size is {vocab_limit} (an id its index did "
                        "not show: the data changed after it was prepared?); re-tokenise the data (re-run titan-npu "
                        "prepare-data into a new --output)")
    batch = torch.from_numpy(rows.astype(np.int64))
    if not documents:
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    starts = [packed.doc_starts(w) for packed, w in picks]
    return (batch[:, :-1].contiguous(), batch[:, 1:].contiguous(),
            Documents.from_starts(starts, picks[0][0].seq_len, reset_positions=documents == "positions"))


class Refused:
    """A DataError met in a loader worker, handed back as the batch: the main process raises it as one line
    (the DataLoader would wrap a raised one in the worker's traceback)."""

    def __init__(self, message: str):
        self.message = message


class PrefetchingLoader:
    """What the one-source and the mixture loaders share: batches of `_dataset` for the keys of a sampler, made
    ahead by `num_workers` processes that leave signals to the trainer; a worker's DataError comes back as one line.
    The state is what was handed out, never what was prefetched."""

    batch_size: int
    dp_world_size: int
    num_workers: int
    pin_memory: bool
    _dataset: Dataset
    _iter: Iterator | None = None

    @property
    def step(self) -> int:
        """Windows consumed per global step (all dp ranks together)."""
        return self.batch_size * self.dp_world_size

    def __iter__(self) -> PrefetchingLoader:
        return self

    def _next_batch(self, sampler: Callable[[], Sampler]) -> tuple:
        """The next batch; the workers start (with `sampler()`'s keys) when none are running."""
        if self._iter is None:
            self._iter = iter(DataLoader(self._dataset, batch_size=None, sampler=sampler(),
                                         num_workers=self.num_workers, pin_memory=self.pin_memory,
                                         prefetch_factor=2 if self.num_workers else None,
                                         worker_init_fn=leave_signals_to_parent if self.num_workers else None))
        batch = next(self._iter)
        if isinstance(batch, Refused):
            self.close()
            raise DataError(batch.message)
        return batch

    def close(self) -> None:
        """Stop the prefetch workers (they restart on the next batch)."""
        self._iter = None

    def _check_run(self, state: dict, seed: int, allow_reshard: bool) -> None:
        """DataError when a saved loader state was made with another seed, or another data-parallel size that the
        caller does not allow to reshard."""
        if int(state["seed"]) != seed:
            raise DataError(f"data loader state used seed {state['seed']}, the run uses {seed}; "
                            "resume with the same training.seed")
        if int(state["dp_world_size"]) != self.dp_world_size and not allow_reshard:
            raise DataError(
                f"data loader state was saved with dp_world_size {state['dp_world_size']}, the run has "
                f"{self.dp_world_size}; resume with the same data-parallel size or allow resharding the data")

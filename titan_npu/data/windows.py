"""Documents packed into windows of seq_len + 1 tokens (the unit every loader hands out), and a refusal met in a
loader worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from titan_npu.data.datasets import TokenDataset
from titan_npu.errors import DataError
from titan_npu.ops.cross_entropy import IGNORE_INDEX
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

    def label_mask(self, w: int) -> None:
        """Text data: every token is a label."""
        return None


PACK_LOOKBACK = 16  # windows a conversation may join; bounds the packing's cost at any corpus size


class ConversationWindows:
    """Whole conversations (chat data: a loss mask per token) placed into windows of seq_len + 1 tokens, padded at
    the end: with `pack` each goes into the first of the PACK_LOOKBACK most recent windows with room for it (first
    fit, in document order: deterministic), else into a new one; without `pack` one per window.

    A conversation longer than seq_len + 1 tokens is cut to that length (overlong = "truncate": the end of its last
    assistant turns goes) or left out ("drop"); one whose cut leaves no assistant token is left out too. Both are
    counted (truncated, dropped). The padding is never a label and is a document of its own.
    """

    def __init__(self, dataset: TokenDataset, doc_ids: np.ndarray, seq_len: int, pack: bool = True,
                 overlong: str = "truncate", pad_id: int = 0):
        if overlong not in ("truncate", "drop"):
            raise DataError(f"data.overlong={overlong!r} is unknown; use 'truncate' or 'drop'")
        self.dataset, self.seq_len, self.pad_id = dataset, seq_len, pad_id
        cap = seq_len + 1
        lengths = dataset.doc_lengths[doc_ids].astype(np.int64)
        keep = np.ones(len(doc_ids), dtype=bool)
        long = np.flatnonzero(lengths > cap)
        if overlong == "drop":
            keep[long] = False
        else:  # a cut conversation must keep an assistant token to learn from (the first token is never a label)
            keep[[i for i in long if not dataset.read_mask(int(doc_ids[i]), 1, cap).any()]] = False
        self.dropped = int((~keep).sum())
        self.truncated = len(long) - self.dropped
        self.doc_ids = doc_ids[keep]
        self.lengths = np.minimum(lengths[keep], cap)
        rows: list[list[int]] = []
        room: list[int] = []
        for i, n in enumerate(self.lengths.tolist()):
            target = next((r for r in range(max(0, len(rows) - PACK_LOOKBACK), len(rows)) if room[r] >= n), -1) \
                if pack else -1
            if target < 0:
                rows.append([])
                room.append(cap)
            rows[target].append(i)
            room[target] -= n
        # window w holds conversations order[bounds[w]:bounds[w + 1]] (indices into doc_ids / lengths)
        self.order = np.array([i for row in rows for i in row], dtype=np.int64)
        self.bounds = np.cumsum([0, *map(len, rows)]).astype(np.int64)
        self.num_windows = len(rows)
        self.num_tokens = int(self.lengths.sum())
        self.num_conversations = len(self.lengths)

    def counts(self) -> dict[str, int]:
        """What packing did: conversations kept, windows, conversations truncated and dropped."""
        return {"conversations": self.num_conversations, "windows": self.num_windows, "truncated": self.truncated,
                "dropped": self.dropped}

    def _members(self, w: int) -> np.ndarray:
        return self.order[int(self.bounds[w]) : int(self.bounds[w + 1])]

    def _pieces(self, w: int, read) -> list[np.ndarray]:
        return [read(int(self.doc_ids[i]), 0, int(self.lengths[i])) for i in self._members(w)]

    def _fill(self, pieces: list[np.ndarray], value: int, dtype: np.dtype) -> np.ndarray:
        row = np.full(self.seq_len + 1, value, dtype=dtype)
        used = sum(len(p) for p in pieces)
        if pieces:
            row[:used] = np.concatenate(pieces)
        return row

    def window(self, w: int) -> np.ndarray:
        """Window w's tokens: its conversations, then pad_id up to seq_len + 1."""
        return self._fill(self._pieces(w, self.dataset.read), self.pad_id, np.dtype(np.int64))

    def label_mask(self, w: int) -> np.ndarray:
        """Window w's loss mask (True = an assistant token to predict); False on the padding."""
        return self._fill(self._pieces(w, self.dataset.read_mask), 0, np.dtype(np.uint8)).astype(bool)

    def doc_starts(self, w: int) -> np.ndarray:
        """Offsets inside window w where a conversation (or the padding) begins."""
        ends = np.cumsum(self.lengths[self._members(w)])
        starts = np.concatenate([[0], ends])
        return (starts if starts[-1] < self.seq_len + 1 else starts[:-1]).astype(np.int64)

    def first_over(self, w: int, limit: int) -> tuple[str, int]:
        """(file, id) of the first conversation in window w holding an id >= limit, for messages."""
        for i in self._members(w):
            piece = self.dataset.read(int(self.doc_ids[i]), 0, int(self.lengths[i]))
            if len(piece) and int(piece.max()) >= limit:
                return self.dataset.where(int(self.doc_ids[i])), int(piece.max())
        return self.dataset.description, limit


Windows = PackedWindows | ConversationWindows


def conversation_counts(windows: list[Windows], names: list[str]) -> dict[str, dict[str, int]]:
    """Per source name, what packing its chat data did (ConversationWindows.counts); text sources are left out."""
    return {name: w.counts() for name, w in zip(names, windows) if isinstance(w, ConversationWindows)}


def batch_of(picks: list[tuple[Windows, int]], vocab_limit: int | None, documents: str) -> tuple:
    """(inputs, labels[, Documents]) of the windows `picks` ((its packed stream, window index) each); labels are
    IGNORE_INDEX where a chat window's loss mask is off; a DataError naming the file when a token id is at or over
    `vocab_limit` (an id the index did not show)."""
    rows = np.stack([packed.window(w) for packed, w in picks])
    if vocab_limit is not None and rows.size and int(rows.max()) >= vocab_limit:
        packed, w = next(pick for pick, row in zip(picks, rows) if int(row.max()) >= vocab_limit)
        where, top = packed.first_over(w, vocab_limit)
        raise DataError(f"{where} holds token id {top} but model.vocab_size is {vocab_limit} (an id its index did "
                        "not show: the data changed after it was prepared?); re-tokenise the data (re-run titan-npu "
                        "prepare-data into a new --output)")
    batch = torch.from_numpy(rows.astype(np.int64))
    labels = batch[:, 1:].contiguous()
    masks = [packed.label_mask(w) for packed, w in picks]
    if any(m is not None for m in masks):
        keep = np.stack([np.ones(rows.shape[1], dtype=bool) if m is None else m for m in masks])[:, 1:]
        labels = labels.masked_fill(~torch.from_numpy(keep), IGNORE_INDEX)
    if not documents:
        return batch[:, :-1].contiguous(), labels
    starts = [packed.doc_starts(w) for packed, w in picks]
    return (batch[:, :-1].contiguous(), labels,
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

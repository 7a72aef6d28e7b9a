"""A weighted mixture of data sources: exact, deterministic proportions, each source on its own shuffled epochs.

The mixture's windows form one global sequence. Window t goes to a source by error diffusion (Blend): among the
sources behind their share (weight x windows so far), the one whose next window is due first. After every window each
source has taken within one window of weight x total (no sampling noise). A source's k-th window is window
k % n of its epoch k // n, in that epoch's permutation (seeded by training.seed, the source's name and the epoch), so a
source that runs out starts its next epoch reshuffled.

Global step s takes windows [T, T + batch_size * dp_world_size) of the sequence, rank r the r-th batch_size of them.
The state is the per-source counts (and the point where the weights last changed): any batch is a pure function of
it, so resuming is exact, and a different dp_world_size continues with the same global sequence.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections import deque
from collections.abc import Iterator

import numpy as np
from torch.utils.data import Dataset, Sampler

from titan_npu.data.windows import PrefetchingLoader, Refused, Windows, batch_of, conversation_counts
from titan_npu.errors import DataError

log = logging.getLogger("titan_npu")
STATE_KIND = "mixture"
_EPS = 1e-9


class Blend:
    """Which source each next window comes from: Tijdeman's earliest-due rule, within one window of the weights.

    counts: windows each source has taken; base: the counts when these weights took over (a resumed run may change
    the weights: the new proportions hold for the windows from then on).
    """

    def __init__(self, weights: list[float], counts: list[int] | None = None, base: list[int] | None = None):
        self.weights = list(weights)
        self.counts = list(counts) if counts is not None else [0] * len(weights)
        self.base = list(base) if base is not None else list(self.counts)
        self._live = [(i, w, 1.0 / w) for i, w in enumerate(self.weights) if w > 0]

    @property
    def total(self) -> int:
        """Windows taken from every source together."""
        return sum(self.counts)

    def take(self, n: int, first: int = 0, size: int | None = None) -> list[tuple[int, int]]:
        """Advance by n windows; windows first .. first + size of them (default all) as (source, k): the source's
        k-th window."""
        last = n if size is None else first + size
        c, b, live = self.counts, self.base, self._live
        done = sum(c) - sum(b)
        rows = []
        for t in range(n):
            done += 1
            best, due = live[0][0], math.inf
            for i, w, inv in live:
                taken = c[i] - b[i]
                if w * done - taken > _EPS and (taken + 1) * inv < due:
                    best, due = i, (taken + 1) * inv
            if first <= t < last:
                rows.append((best, c[best]))
            c[best] += 1
        return rows

    def copy(self) -> Blend:
        return Blend(self.weights, self.counts, self.base)


class _MixtureBatches(Dataset):
    """Key: this rank's rows as (source, k) pairs -> (inputs, labels[, documents]); runs in the loader's workers."""

    def __init__(self, windows: list[Windows], names: list[str], max_epochs: list[int], seed: int,
                 documents: str = "", vocab_limit: int | None = None):
        self.windows, self.names, self.max_epochs = windows, names, max_epochs
        self.seeds = [[seed, zlib.crc32(name.encode())] for name in names]
        self.documents, self.vocab_limit = documents, vocab_limit
        self.sizes = [w.num_windows for w in windows]
        self._perms: list[tuple[int, np.ndarray] | None] = [None] * len(windows)  # per source: its epoch's order

    def _permutation(self, source: int, epoch: int) -> tuple[int, np.ndarray]:
        """Source's window order in `epoch` (seeded by the run's seed, its name and the epoch), past max_epochs none."""
        if self.max_epochs[source] and epoch >= self.max_epochs[source]:
            raise DataError(
                f"data source {self.names[source]!r} ({self.windows[source].dataset.description}) has been read "
                f"{epoch} time(s), its max_epochs = {self.max_epochs[source]}; raise its max_epochs, give it more "
                "data or lower its weight")
        order = np.random.default_rng([*self.seeds[source], epoch]).permutation(self.sizes[source])
        self._perms[source] = (epoch, order)
        return epoch, order

    def __getitem__(self, key: tuple | Refused) -> tuple | Refused:
        try:
            return self._batch(key)
        except DataError as e:
            return Refused(str(e))

    def _batch(self, key: tuple) -> tuple:
        sizes, perms, windows = self.sizes, self._perms, self.windows
        rows = []
        for s, k in key:  # source s's k-th window: place k % n of its epoch k // n's permutation
            epoch, i = divmod(k, sizes[s])
            perm = perms[s]
            if perm is None or perm[0] != epoch:
                perm = self._permutation(s, epoch)
            rows.append((s, int(perm[1][i])))
        return batch_of([(windows[s], w) for s, w in rows], self.vocab_limit, self.documents)


def rank_rows(blend: Blend, batch_size: int, dp_rank: int, dp_world_size: int) -> tuple[tuple[int, int], ...]:
    """Advance blend by one global step; this rank's rows as (source, k): its k-th window."""
    return tuple(blend.take(batch_size * dp_world_size, dp_rank * batch_size, batch_size))


class _StepSampler(Sampler):
    """Keys for every global step from a blend's position on, forever; the counts after each step go to `after` (in
    the main process, as the keys are made), so the loader need not work the blend out a second time."""

    def __init__(self, blend: Blend, batch_size: int, dp_rank: int, dp_world_size: int):
        self.blend, self.batch_size, self.dp_rank, self.dp_world_size = blend, batch_size, dp_rank, dp_world_size
        self.after: deque[list[int]] = deque()

    def __iter__(self) -> Iterator[tuple]:
        blend = self.blend.copy()
        while True:
            key = rank_rows(blend, self.batch_size, self.dp_rank, self.dp_world_size)
            self.after.append(list(blend.counts))
            yield key


class MixtureLoader(PrefetchingLoader):
    """Infinite iterator of (inputs, labels[, documents]) drawn from named, weighted sources; state_dict() /
    load_state_dict(); source_tokens() for the accounting."""

    def __init__(self, windows: list[Windows], names: list[str], weights: list[float], max_epochs: list[int],
                 batch_size: int, dp_rank: int, dp_world_size: int, seed: int, num_workers: int = 0,
                 pin_memory: bool = False, documents: str = "", vocab_limit: int | None = None):
        if not 0 <= dp_rank < dp_world_size:
            raise DataError(f"dp_rank={dp_rank} is outside dp_world_size={dp_world_size}; check the parallel layout")
        for name, w in zip(names, windows):
            if w.num_windows < 1:
                raise DataError(f"data source {name!r} ({w.dataset.description}) has {w.num_tokens} tokens, fewer "
                                f"than one window of seq_len+1={w.seq_len + 1}; give it more data or drop it")
        self.windows, self.names, self.max_epochs = windows, names, max_epochs
        self.batch_size, self.dp_rank, self.dp_world_size = batch_size, dp_rank, dp_world_size
        self.seed, self.split = seed, "train"
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.blend = Blend(weights)
        self.retired: dict[str, int] = {}  # windows taken from sources a resumed run no longer has
        self._dataset = _MixtureBatches(windows, names, max_epochs, seed, documents, vocab_limit)
        self._iter: Iterator | None = None
        self._sampler: _StepSampler | None = None

    def __next__(self) -> tuple:
        batch = self._next_batch(self._new_sampler)
        before = self.blend.counts
        self.blend.counts = self._sampler.after.popleft()
        self._log_new_epochs(before)
        return batch

    def _log_new_epochs(self, before: list[int]) -> None:
        for s, (was, now, n) in enumerate(zip(before, self.blend.counts, self._dataset.sizes)):
            if now > was and (now - 1) // n > max(was - 1, 0) // n and self.dp_rank == 0:
                epoch = (now - 1) // n  # of the last window taken (0-based)
                log.info("data: source %r ran out after %d epoch(s) of %d windows; epoch %d begins, reshuffled",
                         self.names[s], epoch, n, epoch + 1)

    def conversation_counts(self) -> dict[str, dict[str, int]]:
        """Per chat source: conversations kept, windows, truncated and dropped ({} when every source is text)."""
        return conversation_counts(self.windows, self.names)

    def source_tokens(self) -> dict[str, int]:
        """Tokens handed out so far (all ranks) per source name, sources a resumed run dropped included."""
        seq_len = self.windows[0].seq_len
        out = {name: c * seq_len for name, c in zip(self.names, self.blend.counts)}
        out.update({name: c * seq_len for name, c in self.retired.items() if name not in out})
        return out

    @property
    def position(self) -> tuple:
        """The blend's counts and base: where the next batch starts."""
        return tuple(self.blend.counts), tuple(self.blend.base)

    def place(self, dp_rank: int, dp_world_size: int, position: tuple | None = None) -> None:
        """Read on as dp_rank of dp_world_size from `position` (default: where the loader is)."""
        if not 0 <= dp_rank < dp_world_size:
            raise DataError(f"dp_rank={dp_rank} is outside dp_world_size={dp_world_size}; check the parallel layout")
        counts, base = position if position is not None else self.position
        if (dp_rank, dp_world_size, tuple(counts), tuple(base)) == (self.dp_rank, self.dp_world_size,
                                                                    *self.position):
            return
        self.close()
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.blend = Blend(self.blend.weights, list(counts), list(base))

    def state_dict(self) -> dict:
        """Per source: its windows, weight, windows taken and taken when the weights last changed; plain values."""
        sources = {name: {"num_windows": w.num_windows, "weight": wt, "taken": c, "base": b}
                   for name, w, wt, c, b in zip(self.names, self.windows, self.blend.weights, self.blend.counts,
                                                self.blend.base)}
        return {"version": 2, "kind": STATE_KIND, "seed": self.seed, "split": self.split,
                "seq_len": self.windows[0].seq_len, "sources": sources, "retired": dict(self.retired),
                "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict, allow_reshard: bool = False) -> None:
        """Continue where state left off; changed weights (or sources) apply from here on, said in one log line."""
        if state.get("kind") != STATE_KIND:
            raise DataError(
                f"the checkpoint's data position is for one source (data.path), this run reads a mixture of "
                f"{len(self.names)} sources; resume with the same data.path, or start the mixture as a new run from "
                "its weights (--checkpoint.initial_load <checkpoint step folder> with a new --checkpoint_dir)")
        for key in ("seq_len", "sources", "seed", "dp_world_size"):
            if key not in state:
                raise DataError(f"data loader state has no '{key}'; the checkpoint is not from this loader")
        if int(state["seq_len"]) != self.windows[0].seq_len:
            raise DataError(f"data loader state is for seq_len {state['seq_len']}, this run has "
                            f"{self.windows[0].seq_len}; resume with the same training.seq_len")
        self._check_run(state, self.seed, allow_reshard)
        saved: dict = state["sources"]
        for name, w in zip(self.names, self.windows):
            if name in saved and int(saved[name]["num_windows"]) != w.num_windows:
                raise DataError(f"data source {name!r} had {saved[name]['num_windows']} windows when the checkpoint "
                                f"was saved, it has {w.num_windows} now; resume with the same data for it (or give "
                                "the changed data another name)")
        counts = [int(saved[name]["taken"]) if name in saved else 0 for name in self.names]
        old = {name: float(s["weight"]) for name, s in saved.items()}
        new = dict(zip(self.names, self.blend.weights))
        retired = {name: int(s["taken"]) for name, s in saved.items() if name not in new}
        retired.update({k: int(v) for k, v in dict(state.get("retired", {})).items() if k not in new})
        if _same_weights(old, new):
            base = [int(saved[name].get("base", 0)) for name in self.names]
        else:
            base = list(counts)
            if self.dp_rank == 0:
                log.warning("data: the mixture changed on resume (%s -> %s); the new proportions apply from window "
                            "%d on, the per-source counts carry over", _show(old), _show(new), sum(counts))
        self.close()
        self.retired = retired
        self.blend = Blend(self.blend.weights, counts, base)

    def _new_sampler(self) -> _StepSampler:
        self._sampler = _StepSampler(self.blend, self.batch_size, self.dp_rank, self.dp_world_size)
        return self._sampler


def _same_weights(old: dict[str, float], new: dict[str, float]) -> bool:
    return old.keys() == new.keys() and all(math.isclose(old[k], new[k], rel_tol=1e-9, abs_tol=1e-12) for k in old)


def _show(weights: dict[str, float]) -> str:
    return " ".join(f"{name}={w:.3g}" for name, w in weights.items())

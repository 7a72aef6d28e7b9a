"""The training data loader: documents packed into seq_len + 1 windows, shuffled per epoch, split across dp ranks.

Global step k of an epoch takes windows perm[pos : pos + batch_size * dp_world_size] of that epoch's permutation,
rank r the r-th batch_size of them. The loader's whole state is (epoch, pos): any batch is a pure function of it,
so resuming is exact whatever num_workers prefetches, and a changed dp_world_size continues at the same window.

With document masking (data.document_mask) each batch also carries its Documents (ops/documents.py): where the
documents begin in each window, read from the dataset's document lengths (every document ends with EOS), so they
too are a pure function of (epoch, pos).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from titan_npu.config.mixture import sources_of
from titan_npu.config.schema import DataSource, JobConfig
from titan_npu.data.chat import ChatSource, chat_source
from titan_npu.data.datasets import TokenDataset, open_dataset, verify_dataset
from titan_npu.data.tokenizer import Tokenizer
from titan_npu.data.windows import (
    ConversationWindows,
    PackedWindows,
    PrefetchingLoader,
    Refused,
    Windows,
    batch_of,
    conversation_counts,
)
from titan_npu.errors import DataError

if TYPE_CHECKING:
    from titan_npu.data.mixture import MixtureLoader

log = logging.getLogger("titan_npu")
_GOLDEN = 0.6180339887498949  # Weyl sequence step: spreads held-out documents evenly over the corpus
STATE_VERSION = 1


def split_documents(num_docs: int, val_fraction: float, split: str) -> np.ndarray:
    """Document ids of split: a fixed, evenly spread val_fraction of the documents is 'validation'."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1); set it to e.g. 0.01")
    if split not in ("train", "validation"):
        raise DataError(f"split {split!r} is unknown; use 'train' or 'validation'")
    held_out = (np.arange(num_docs, dtype=np.float64) * _GOLDEN) % 1.0 < val_fraction
    return np.flatnonzero(held_out if split == "validation" else ~held_out)


class _BatchDataset(Dataset):
    """Key (epoch, pos) -> this rank's (inputs, labels[, documents]); runs in the loader's worker processes.

    Every batch is checked against vocab_limit (the model's vocab_size) before it leaves: an id the model has no
    embedding for never reaches it, whatever the dataset's index said (the check costs one max over the batch).
    """

    def __init__(self, windows: Windows, batch_size: int, dp_rank: int, seed: int, shuffle: bool,
                 documents: str = "", vocab_limit: int | None = None):
        self.windows, self.batch_size, self.dp_rank = windows, batch_size, dp_rank
        self.seed, self.shuffle = seed, shuffle
        self.documents = documents  # "" none, "mask" document ids, "positions" ids and positions inside documents
        self.vocab_limit = vocab_limit
        self._perm: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            n = self.windows.num_windows
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._perm = (epoch, order)
        return self._perm[1]

    def __getitem__(self, key: tuple[int, int]) -> tuple | Refused:
        try:
            return self._batch(key)
        except DataError as e:
            return Refused(str(e))

    def _batch(self, key: tuple[int, int]) -> tuple:
        epoch, pos = key
        first = pos + self.dp_rank * self.batch_size
        ids = self.permutation(epoch)[first : first + self.batch_size]
        return batch_of([(self.windows, int(w)) for w in ids], self.vocab_limit, self.documents)


class _CursorSampler(Sampler):
    """Keys (epoch, pos) from a starting point on, forever; an epoch ends when a whole global batch no longer fits."""

    def __init__(self, epoch: int, pos: int, step: int, num_windows: int):
        self.epoch, self.pos, self.step, self.num_windows = epoch, pos, step, num_windows

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, pos = self.epoch, self.pos
        while True:
            yield epoch, pos
            epoch, pos = wrap(epoch, pos + self.step, self.step, self.num_windows)


def wrap(epoch: int, pos: int, step: int, num_windows: int) -> tuple[int, int]:
    """(epoch, pos) itself, or the start of the next epoch when a whole global batch no longer fits."""
    return (epoch + 1, 0) if pos + step > num_windows else (epoch, pos)


class TokenLoader(PrefetchingLoader):
    """Infinite iterator of (inputs, labels) LongTensors [batch_size, seq_len], with documents="mask" or
    "positions" (inputs, labels, Documents); state_dict() / load_state_dict()."""

    def __init__(self, windows: Windows, batch_size: int, dp_rank: int, dp_world_size: int, seed: int,
                 num_workers: int = 0, pin_memory: bool = False, shuffle: bool = True, split: str = "train",
                 documents: str = "", vocab_limit: int | None = None, name: str = "", max_epochs: int = 0):
        if not 0 <= dp_rank < dp_world_size:
            raise DataError(f"dp_rank={dp_rank} is outside dp_world_size={dp_world_size}; check the parallel layout")
        global_batch = batch_size * dp_world_size
        if windows.num_windows < global_batch:
            raise DataError(
                f"{windows.dataset.description} ({split}) has {windows.num_tokens} tokens = {windows.num_windows} "
                f"window(s) of seq_len+1={windows.seq_len + 1}, fewer than one global batch of {global_batch} "
                f"(batch_size {batch_size} x dp {dp_world_size}); use more data or a smaller batch_size / seq_len"
            )
        self.windows = windows
        self.batch_size, self.dp_rank, self.dp_world_size = batch_size, dp_rank, dp_world_size
        self.seed, self.shuffle, self.split = seed, shuffle, split
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.pos = 0, 0
        self.name, self.max_epochs = name, max_epochs  # max_epochs: 0 = no limit
        self._dataset = _BatchDataset(windows, batch_size, dp_rank, seed, shuffle, documents, vocab_limit)
        self._iter: Iterator | None = None

    def __next__(self) -> tuple:
        if self.max_epochs and self.epoch >= self.max_epochs:
            raise DataError(f"data source {self.name!r} ({self.windows.dataset.description}) has been read "
                            f"{self.epoch} time(s), its max_epochs = {self.max_epochs}; raise its max_epochs or give "
                            "it more data")
        batch = self._next_batch(lambda: _CursorSampler(self.epoch, self.pos, self.step, self.windows.num_windows))
        epoch = self.epoch
        self.epoch, self.pos = wrap(self.epoch, self.pos + self.step, self.step, self.windows.num_windows)
        if self.epoch > epoch and self.split == "train" and self.dp_rank == 0:
            log.info("data: %s ran out after %d epoch(s) of %d windows; epoch %d begins, reshuffled",
                     repr(self.name) if self.name else self.windows.dataset.description, self.epoch,
                     self.windows.num_windows, self.epoch + 1)
        return batch

    def source_tokens(self) -> dict[str, int]:
        """Tokens per source: one source has only the run's total (see MixtureLoader)."""
        return {}

    def conversation_counts(self) -> dict[str, dict[str, int]]:
        """Chat data: conversations kept, windows, truncated and dropped, under the source's name ({} for text)."""
        return conversation_counts([self.windows], [self.name or self.windows.dataset.description])

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, pos) of the next batch."""
        return self.epoch, self.pos

    def place(self, dp_rank: int, dp_world_size: int, position: tuple[int, int] | None = None) -> None:
        """Read on as dp_rank of dp_world_size from `position` (default: where the loader is).

        Fault tolerance splits each step among the replica groups taking part, and reads a step that did not
        commit again; the prefetch workers restart only when something changed.
        """
        if not 0 <= dp_rank < dp_world_size:
            raise DataError(f"dp_rank={dp_rank} is outside dp_world_size={dp_world_size}; check the parallel layout")
        if self.batch_size * dp_world_size > self.windows.num_windows:
            raise DataError(f"{self.windows.num_windows} window(s) of data are fewer than one global batch of "
                            f"{self.batch_size * dp_world_size}; use more data or a smaller batch_size / seq_len")
        epoch, pos = position if position is not None else self.position
        if (dp_rank, dp_world_size, epoch, pos) == (self.dp_rank, self.dp_world_size, self.epoch, self.pos):
            return
        self.close()
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._dataset.dp_rank = dp_rank
        self.epoch, self.pos = wrap(epoch, pos, self.step, self.windows.num_windows)

    def state_dict(self) -> dict:
        """Where the next batch starts; plain ints and strings (saved per rank in checkpoints)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "pos": self.pos, "seed": self.seed, "split": self.split,
                "seq_len": self.windows.seq_len, "num_windows": self.windows.num_windows,
                "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict, allow_reshard: bool = False) -> None:
        """Continue exactly where state left off; a different dp_world_size needs allow_reshard=True."""
        if state.get("kind") == "mixture":
            raise DataError(f"the checkpoint's data position is a mixture of {len(state.get('sources', {}))} sources "
                            f"({', '.join(state.get('sources', {}))}), this run reads one; resume with the same "
                            "data.sources, or start the new data as a new run from its weights "
                            "(--checkpoint.initial_load <checkpoint step folder> with a new --checkpoint_dir)")
        for key in ("epoch", "pos", "seq_len", "num_windows", "dp_world_size", "seed"):
            if key not in state:
                raise DataError(f"data loader state has no '{key}'; the checkpoint is not from this loader")
        if int(state["seq_len"]) != self.windows.seq_len or int(state["num_windows"]) != self.windows.num_windows:
            raise DataError(
                f"data loader state is for {state['num_windows']} windows of seq_len {state['seq_len']}, this data has "
                f"{self.windows.num_windows} of seq_len {self.windows.seq_len}; resume with the same data and seq_len"
            )
        self._check_run(state, self.seed, allow_reshard)
        self.close()
        self.epoch, self.pos = wrap(int(state["epoch"]), int(state["pos"]), self.step, self.windows.num_windows)

    def doc_starts(self, batch_key: tuple[int, int] | None = None) -> list[np.ndarray]:
        """Per row of the next batch (or of batch_key): offsets where documents begin, for document masking."""
        epoch, pos = batch_key or (self.epoch, self.pos)
        first = pos + self.dp_rank * self.batch_size
        ids = self._dataset.permutation(epoch)[first : first + self.batch_size]
        return [self.windows.doc_starts(int(w)) for w in ids]

def build_dataloader(cfg: JobConfig, tokenizer: Tokenizer | None, dp_rank: int, dp_world_size: int,
                     split: str = "train", device_type: str = "cpu", model_vocab_size: int | None = None,
                     source: str | None = None) -> TokenLoader | MixtureLoader:
    """The loader for one data-parallel rank: cfg.data (or cfg.validation.data for validation), see module doc.

    Training on several data.sources gives a MixtureLoader (data/mixture.py); `source` names one source of the
    mixture to read alone (its held-out split, for per-source validation).
    """
    if split not in ("train", "validation"):
        raise DataError(f"split {split!r} is unknown; use 'train' or 'validation'")
    seq_len, batch_size = cfg.training.seq_len, cfg.training.batch_size
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"training.seq_len={seq_len} and training.batch_size={batch_size} must be >= 1")
    pin = device_type in ("cuda", "npu") and _accelerator_available()
    sources = sources_of(cfg.data)
    if source is not None:
        sources = [s for s in sources if s.name == source]
    if split == "train" and len(sources) > 1:
        from titan_npu.data.mixture import MixtureLoader

        opened = open_sources(cfg, tokenizer, model_vocab_size)
        loader = MixtureLoader(
            [windows_of(cfg, ds, split_documents(ds.num_docs, cfg.data.val_fraction, "train"), tokenizer,
                        s.name if dp_rank == 0 else None) for s, ds in opened],
            [s.name for s, _ in opened], [s.weight for s, _ in opened], [s.max_epochs for s, _ in opened],
            batch_size, dp_rank, dp_world_size, seed=cfg.training.seed, num_workers=max(0, cfg.data.num_workers),
            pin_memory=pin, documents=batch_documents(cfg), vocab_limit=model_vocab_size)
        for _, ds in opened:
            ds.write_caches()
        return loader
    src = sources[0]
    chat = _chat(cfg, tokenizer)
    if split == "validation" and cfg.validation.data and source is None:
        dataset = open_dataset(cfg.validation.data, tokenizer, cfg.data.text_field, chat=chat)
        doc_ids = np.arange(dataset.num_docs)
    else:
        dataset = open_dataset(src.path, tokenizer, src.text_field, chat=chat)
        if split == "validation" and cfg.data.val_fraction <= 0:
            raise DataError("no validation data: set data.val_fraction > 0 or validation.data to a path")
        doc_ids = split_documents(dataset.num_docs, cfg.data.val_fraction, split)
    verify_dataset(dataset, tokenizer, model_vocab_size)
    windows = windows_of(cfg, dataset, doc_ids, tokenizer, src.name if dp_rank == 0 and split == "train" else None)
    loader = TokenLoader(windows, batch_size, dp_rank, dp_world_size,
                         seed=cfg.training.seed, num_workers=max(0, cfg.data.num_workers), pin_memory=pin,
                         shuffle=split == "train", split=split, documents=batch_documents(cfg),
                         vocab_limit=model_vocab_size, name=src.name,
                         max_epochs=src.max_epochs if split == "train" else 0)
    dataset.write_caches()  # the data is accepted: now its index may be kept beside it
    return loader


def open_sources(cfg: JobConfig, tokenizer: Tokenizer | None, model_vocab_size: int | None = None,
                 ) -> list[tuple[DataSource, TokenDataset]]:
    """Every source of the run's data, opened and checked: it exists, holds text in its field, was made with the
    run's tokenizer (and so the same as the others), fits the model's vocabulary, and holds one window of training
    tokens at least. Nothing is written (caches are written once the whole run is accepted)."""
    seq_len = cfg.training.seq_len
    chat = _chat(cfg, tokenizer)
    opened: list[tuple[DataSource, TokenDataset]] = []
    for i, src in enumerate(sources_of(cfg.data)):
        label = f"data source {src.name!r} (data.sources[{i}])" if cfg.data.sources else "data.path"
        try:
            ds = open_dataset(src.path, tokenizer, src.text_field, chat=chat)
        except DataError as e:
            raise (DataError(f"{label}: {e}") if cfg.data.sources else e) from None
        for other, ods in opened:
            if ds.tokenizer_fingerprint and ods.tokenizer_fingerprint and \
                    ds.tokenizer_fingerprint != ods.tokenizer_fingerprint:
                raise DataError(f"{label} was tokenised with another tokenizer ({ds.tokenizer_fingerprint}) than "
                                f"source {other.name!r} ({ods.tokenizer_fingerprint}); prepare every source with the "
                                "run's data.tokenizer")
        try:
            verify_dataset(ds, tokenizer, model_vocab_size)
        except DataError as e:
            raise (DataError(f"{label}: {e}") if cfg.data.sources else e) from None
        train = windows_of(cfg, ds, split_documents(ds.num_docs, cfg.data.val_fraction, "train"), tokenizer)
        if train.num_windows < 1:
            raise DataError(f"{label} ({ds.description}) holds {train.num_tokens} training tokens, fewer than one "
                            f"window of seq_len+1 = {seq_len + 1}; give it more data or drop it from data.sources")
        opened.append((src, ds))
    return opened


def _chat(cfg: JobConfig, tokenizer: Tokenizer | None) -> ChatSource | None:
    """How chat records are read (data.format chat / instruction); None for text data."""
    if cfg.data.format == "text":
        return None
    if tokenizer is None:
        raise DataError(f"data.format = {cfg.data.format!r} renders records with a chat template and needs "
                        "data.tokenizer")
    return chat_source(cfg.data, tokenizer)


def windows_of(cfg: JobConfig, ds: TokenDataset, doc_ids: np.ndarray, tokenizer: Tokenizer | None,
               log_as: str | None = None) -> Windows:
    """The windows a dataset is read in: text packed as one stream, chat data (a loss mask) as whole conversations
    (data.pack, data.overlong); `log_as` names the source in the line that counts them (None: no line)."""
    seq_len = cfg.training.seq_len
    if not ds.has_mask:
        return PackedWindows(ds, doc_ids, seq_len)
    pad = next((t for t in (tokenizer.pad_id, tokenizer.eos_id) if t is not None), 0) if tokenizer else 0
    windows = ConversationWindows(ds, doc_ids, seq_len, cfg.data.pack, cfg.data.overlong, pad)
    if log_as is not None:
        log.info("data: %s: %d conversations in %d windows of %d tokens (%s); %d longer than that truncated, %d "
                 "dropped (data.overlong = %s)", repr(log_as) if log_as else ds.description,
                 windows.num_conversations, windows.num_windows, seq_len + 1,
                 "packed" if cfg.data.pack else "one per window, padded", windows.truncated, windows.dropped,
                 cfg.data.overlong)
    return windows


def batch_documents(cfg: JobConfig) -> str:
    """What each batch carries of its documents: "" nothing, "mask" (data.document_mask), "positions" (and
    data.reset_position_ids)."""
    if not cfg.data.document_mask:
        return ""
    return "positions" if cfg.data.reset_position_ids else "mask"


def _accelerator_available() -> bool:
    accel = getattr(torch, "accelerator", None)
    return bool(accel is not None and accel.is_available())

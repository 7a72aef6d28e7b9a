"""The documents of a batch of packed windows, for attention that stops at document boundaries.

A packed window holds the end of one document and the starts of others (data.document_mask). The loader, which
knows where each document begins, builds a Documents per batch on the host: a document index per position (a
tensor, moved to the device with the batch), the cumulative document ends over the flattened batch (host ints,
what npu_fusion_attention's variable-length TND mode takes, so no kernel reads them back from the device) and, with
data.reset_position_ids, each position's offset inside its document (the RoPE rows). A query attends to a key
when both are in the same document and, causally, the key does not come later.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Documents:
    """Per batch [B, S]: document index per position (ids), cumulative document ends over the B * S flattened
    positions (cu_seqlens, host ints), the position inside its document (positions, or None)."""

    def __init__(self, ids: torch.Tensor, cu_seqlens: list[int], positions: torch.Tensor | None = None) -> None:
        self.ids = ids
        self.cu_seqlens = cu_seqlens
        self.positions = positions
        self._masks: dict[tuple, torch.Tensor] = {}

    @classmethod
    def from_starts(cls, starts: Sequence[np.ndarray], seq_len: int, reset_positions: bool) -> Documents:
        """From the offsets inside each row's window where a document begins (PackedWindows.doc_starts): the
        seq_len input positions of each row; a document already running at a window's start is its first one."""
        ids, positions, cu_seqlens = [], [], []
        arange = np.arange(seq_len, dtype=np.int64)
        for row, row_starts in enumerate(starts):
            inner = np.asarray(row_starts, dtype=np.int64)
            inner = inner[(inner > 0) & (inner < seq_len)]
            row_ids = np.zeros(seq_len, dtype=np.int64)
            row_ids[inner] = 1
            row_ids = np.cumsum(row_ids)
            ids.append(row_ids)
            positions.append(arange - np.concatenate(([0], inner))[row_ids])
            cu_seqlens.extend(int(row * seq_len + s) for s in inner)
            cu_seqlens.append((row + 1) * seq_len)
        ids_t = torch.from_numpy(np.stack(ids).astype(np.int32))
        pos_t = torch.from_numpy(np.stack(positions)) if reset_positions else None
        return cls(ids_t, cu_seqlens, pos_t)

    @classmethod
    def cat(cls, parts: Sequence[Documents]) -> Documents:
        """The documents of several batches' rows, one batch after another (the host ends offset by the positions
        of the rows before)."""
        cu_seqlens, offset = [], 0
        for part in parts:
            cu_seqlens.extend(offset + end for end in part.cu_seqlens)
            offset += part.ids.numel()
        positions = None if parts[0].positions is None else torch.cat([part.positions for part in parts])
        return cls(torch.cat([part.ids for part in parts]), cu_seqlens, positions)

    def split(self, n: int) -> list[Documents]:
        """The documents of n microbatches, the rows cut as torch.tensor_split cuts the batch (a pipeline's
        microbatches), each microbatch's host ends counted from its own first position."""
        seq_len = self.ids.shape[1]
        parts, start = [], 0
        for ids in torch.tensor_split(self.ids, n):
            stop = start + ids.shape[0]
            lo, hi = start * seq_len, stop * seq_len
            positions = None if self.positions is None else self.positions[start:stop]
            parts.append(Documents(ids, [end - lo for end in self.cu_seqlens if lo < end <= hi], positions))
            start = stop
        return parts

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Documents:
        """The same documents with the tensors on `device` (the host ints stay on the host)."""
        positions = None if self.positions is None else self.positions.to(device, non_blocking=non_blocking)
        return Documents(self.ids.to(device, non_blocking=non_blocking), self.cu_seqlens, positions)

    def pin_memory(self) -> Documents:
        """The DataLoader's pin_memory hook: the tensors in page-locked memory."""
        positions = None if self.positions is None else self.positions.pin_memory()
        return Documents(self.ids.pin_memory(), self.cu_seqlens, positions)

    def mask(self, causal: bool = True) -> torch.Tensor:
        """[B, 1, S, S] bool, True where a query may attend to a key (same document; causal: not a later key);
        built once per batch and device."""
        key = ("whole", causal)
        if key not in self._masks:
            self._masks[key] = document_mask(self.ids, self.ids, causal)
        return self._masks[key]

    def cached(self, key: tuple, build) -> torch.Tensor:
        """A mask derived from these documents, built by build() on first use (the ring's block masks)."""
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]


def document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, 1, Sq, Sk] bool of queries with document ids q_ids [B, Sq] against keys k_ids [B, Sk]: True where both
    are in one document (and, causal, the key is not after the query: top-left aligned, as SDPA's is_causal)."""
    same = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        sq, sk = q_ids.shape[1], k_ids.shape[1]
        same = same & torch.ones(sq, sk, dtype=torch.bool, device=q_ids.device).tril()
    return same[:, None]

"""Context parallelism: each sequence split over the cp ranks, with causal load balancing.

The sequence is cut into 2 * cp chunks and rank r holds chunks r and 2 * cp - 1 - r: under the causal mask an early
chunk attends to little and a late one to much, so each rank gets one of each and the same work. Every cp rank
reads the same window from the loader (the cp ranks share a data-parallel coordinate) and keeps its chunks of the
inputs and labels (ContextParallelBatch); the model's attention takes the chunks' true positions for RoPE and
attends across the cp group: ring attention (RingContext, parallel.cp_mode = "ring"), Ulysses attention
(UlyssesContext, "ulysses") or both, Ulysses within groups of ranks and the ring between them (HybridContext,
"hybrid"), which the model's parallelize step installs in each attention (context_for).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_npu.ops.documents import Documents
from titan_npu.parallel.hybrid_attention import hybrid_attention
from titan_npu.parallel.ring_attention import ring_attention
from titan_npu.parallel.ulysses_attention import ulysses_attention


def load_balanced_positions(seq_len: int, rank: int, cp: int, device: torch.device | str | None = None
                            ) -> torch.Tensor:
    """The positions of a seq_len sequence that cp rank `rank` holds: chunks rank and 2 * cp - 1 - rank of 2 * cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2 * cp = {2 * cp} equal chunks")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)))


def shard_sequence(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """This rank's load-balanced chunks of x [B, S, ...] along the sequence (dim 1)."""
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=1)


class LoadBalancedContext:
    """What an attention layer needs under context parallelism: the positions of its local chunks (the
    load-balanced split) and, in a subclass, attention across the cp group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}

    def positions(self, local_len: int, device: torch.device, documents: Documents | None = None) -> torch.Tensor:
        """The true positions (rows of the RoPE tables) of this rank's local_len positions; [B, local_len] of
        positions inside each document when the documents carry them (data.reset_position_ids)."""
        if documents is not None and documents.positions is not None:
            return shard_sequence(documents.positions, self.rank, self.size)
        key = (local_len, device)
        if key not in self._positions:
            self._positions[key] = load_balanced_positions(local_len * self.size, self.rank, self.size, device)
        return self._positions[key]

    def token_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A per-token statistic t (a count, no gradient) summed over the cp ranks: over every position of the
        sequences (a collective of the cp group; nothing is read to the host)."""
        total = t.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total


class RingContext(LoadBalancedContext):
    """The local chunks' positions, and ring attention over the cp group."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
                  ) -> torch.Tensor:
        """Causal attention of the local q [B, S_local, Hq, D] against the whole sequence's keys/values (within
        each query's document when documents are given)."""
        return ring_attention(q, k, v, self.group, documents)


class UlyssesContext(LoadBalancedContext):
    """The local chunks' positions, and Ulysses attention (all-to-all to a head split) over the cp group."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
                  ) -> torch.Tensor:
        """Causal attention of the local q [B, S_local, Hq, D] against the whole sequence's keys/values (within
        each query's document when documents are given)."""
        return ulysses_attention(q, k, v, self.group, documents)


class HybridContext(LoadBalancedContext):
    """The local chunks' positions, and hybrid attention: Ulysses within groups of adjacent cp ranks, the ring
    between the groups (hybrid_attention.py)."""

    def __init__(self, group: dist.ProcessGroup, ulysses_group: dist.ProcessGroup,
                 ring_group: dist.ProcessGroup) -> None:
        super().__init__(group)
        self.ulysses_group, self.ring_group = ulysses_group, ring_group

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
                  ) -> torch.Tensor:
        """Causal attention of the local q [B, S_local, Hq, D] against the whole sequence's keys/values (within
        each query's document when documents are given)."""
        return hybrid_attention(q, k, v, self.ulysses_group, self.ring_group, documents)


CONTEXTS = {"ring": RingContext, "ulysses": UlyssesContext, "hybrid": HybridContext}


def context_for(mode: str, group: dist.ProcessGroup,
                hybrid_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None) -> LoadBalancedContext:
    """The attention context of parallel.cp_mode `mode` over the cp group; hybrid also takes (Ulysses group, ring
    group) of this rank (ParallelDims.hybrid_cp_groups)."""
    if mode not in CONTEXTS:
        raise ValueError(f"parallel.cp_mode = {mode!r} has no attention context; use one of {', '.join(CONTEXTS)}")
    if mode == "hybrid":
        if hybrid_groups is None:
            raise ValueError("parallel.cp_mode = 'hybrid' needs its Ulysses and ring groups "
                             "(ParallelDims.hybrid_cp_groups())")
        return HybridContext(group, *hybrid_groups)
    return CONTEXTS[mode](group)


class ContextParallelBatch:
    """This cp rank's share of each batch (the loss weights each share by its valid labels: trainer/loss.py)."""

    def __init__(self, rank: int, cp: int) -> None:
        self.rank, self.cp = rank, cp

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's load-balanced chunks of a batch x [B, S, ...] every cp rank holds whole."""
        return shard_sequence(x, self.rank, self.cp)

    def split(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local inputs, local labels) of a batch [B, S] every cp rank holds whole."""
        return self.local(inputs), self.local(labels)

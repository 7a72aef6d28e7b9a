"""Replica groups that outlive each other's failures, on torchft (docs/reliability.md, "Fault tolerance").

Each replica group is its own torchrun job: FSDP2 (and any other parallelism) inside it, the same layout in every
group. A torchft lighthouse forms, at the start of every step, the quorum of the groups that are up; torchft's
managed process group then averages the gradients across them (rank r of each group with rank r of the others),
and a step commits only when the groups that took part agree. A group that dies leaves the quorum and the others
step on; a group that (re)starts behind the others heals before its first step by fetching the live weights,
optimizer, schedule, step and data position from a peer (checkpoint/live.py), with no checkpoint reload.

The data of a step is one stretch of the global window stream (data/loader.py), split among the groups that take
part: group q of n reads slice q of n. A step that does not commit is read again by the next quorum, so no window
is trained twice or skipped; while fewer groups are up, a step trains fewer windows (a smaller global batch).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_npu.config.schema import FaultToleranceConfig, JobConfig
from titan_npu.errors import ConfigError, DeviceError

log = logging.getLogger("titan_npu")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable, read when fault_tolerance.lighthouse is ""
TORCHFT_VERSION = "0.2.0"


def import_torchft() -> Any:
    """The torchft package, or a ConfigError saying how to install it."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at info level
    try:
        import torchft
    except ImportError as e:
        raise ConfigError(f"fault_tolerance.enable = true needs torchft: pip install 'titan-npu[ft]' "
                          f"(torchft=={TORCHFT_VERSION}), or set fault_tolerance.enable = false") from e
    return torchft


def lighthouse_address(f: FaultToleranceConfig) -> str:
    """fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE, as an http:// address."""
    address = f.lighthouse.strip() or os.environ.get(LIGHTHOUSE_ENV, "").strip()
    if not address:
        raise ConfigError(f"fault_tolerance.lighthouse is not set (nor {LIGHTHOUSE_ENV}); give the address "
                          "torchft_lighthouse listens on, e.g. http://lighthouse-host:29510")
    return address if "://" in address else f"http://{address}"


def check_lighthouse(address: str, connect_timeout_s: float) -> None:
    """Reach the lighthouse within connect_timeout_s, or raise a one-line DeviceError naming it.

    Its status page answers on the same port as its RPCs; reading it registers nothing (a probe heartbeat would
    count as one more replica in the lighthouse's majority rule until it timed out).
    """
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address}/status", timeout=connect_timeout_s) as response:
            response.read(1)
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise DeviceError(f"fault_tolerance.lighthouse {address} is unreachable within fault_tolerance."
                          f"connect_timeout_s = {connect_timeout_s:g} s ({type(e).__name__}): start "
                          "`torchft_lighthouse --min_replicas N --bind [::]:PORT` on that host, or fix the address"
                          ) from e


def replica_paths(cfg: JobConfig) -> None:
    """Give this replica group its own replica_<id> folder under checkpoint.dir and metrics.log_dir (in place)."""
    leaf = f"replica_{cfg.fault_tolerance.replica_id}"
    for section, key in ((cfg.checkpoint, "dir"), (cfg.metrics, "log_dir")):
        path = Path(getattr(section, key))
        if path.name != leaf:
            setattr(section, key, str(path / leaf))


def _group_store(group_rank: int, group_size: int, host: str) -> tuple[dist.TCPStore | None, str, int]:
    """A new store for this attempt of the group's torchft manager, hosted by group rank 0: (store, host, port).

    A fresh one per start: torchrun's job store outlives a restart and would hand out the dead manager's address.
    """
    store, port = None, 0
    if group_rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = store.port
    if group_size > 1:
        shared: list[Any] = [host, port]
        dist.broadcast_object_list(shared, src=0)
        host, port = shared
    return store, host, port


class ReplicaGroups:
    """This group's seat among the replica groups: quorum, healing, gradient averaging, commit, data split."""

    def __init__(self, cfg: JobConfig, group_rank: int, group_size: int, device: torch.device, dataloader: Any,
                 dp_rank: int, dp_degree: int) -> None:
        f = cfg.fault_tolerance
        ft = import_torchft()
        quiet = logging.getLogger("torchft")
        if quiet.level == logging.NOTSET:  # its lines (tracebacks of a peer's death) repeat ours, which name the error
            quiet.setLevel(logging.CRITICAL)
        from torchft.manager import Manager

        address = lighthouse_address(f)
        check_lighthouse(address, f.connect_timeout_s)
        timeout = timedelta(seconds=f.timeout_s)
        if device.type == "cuda":
            pg = ft.ProcessGroupNCCL(timeout=timeout)
        else:  # gloo on the host: torchft has no HCCL process group, so an NPU's buckets travel through host memory
            pg = ft.ProcessGroupGloo(timeout=timeout)
        self._on_host = device.type not in ("cpu", "cuda")
        self._device = torch.device("cpu") if self._on_host else device
        hostname = f.hostname.strip() or socket.gethostname()
        self._store, host, port = _group_store(group_rank, group_size, hostname)
        self.cfg = f
        self.group_rank = group_rank
        self.loader, self.dp_rank, self.dp_degree = dataloader, dp_rank, dp_degree
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=f.min_replicas,
            use_async_quorum=False,  # heal before the forward pass: a recovering group trains its first step too
            init_sync=False,  # every group starts from the seed's weights (the same in every layout): no transfer
            timeout=timeout, quorum_timeout=timedelta(seconds=f.quorum_timeout_s),
            connect_timeout=timedelta(seconds=f.connect_timeout_s), rank=group_rank, world_size=group_size,
            store_addr=host, store_port=port, lighthouse_addr=address, replica_id=f"titan_npu_{f.replica_id}",
            hostname=hostname,
        )
        self.participants = 0  # replica groups in the current step's quorum
        self.members: list[int] = []  # their ids, learnt when the quorum changes
        self._quorum_id = -1
        self.committed = True
        self._position = dataloader.position
        if group_rank == 0:
            log.info("fault tolerance: replica group %d of %d, lighthouse %s, min_replicas %d", f.replica_id,
                     f.num_replica_groups, address, f.min_replicas)

    def attach(self, live_state: Callable[[], dict[str, Any]], load_live_state: Callable[[dict[str, Any]], None],
               train_state: Any) -> None:
        """Serve live_state() to recovering peers and heal with load_live_state(state); torchft's step follows
        train_state.step (the Trainer: its `step` after a resume)."""
        self.manager.register_state_dict_fn("run", self._healed_with(load_live_state), live_state)
        self.train_state = train_state
        self.manager.load_state_dict({"step": int(train_state.step), "batches_committed": 0})

    def _healed_with(self, load: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        def heal(state: dict[str, Any]) -> None:
            before = int(self.train_state.step)
            load(state)
            if self.group_rank == 0:
                log.info("fault tolerance: replica group %d healed from a live peer: step %d -> %d (no checkpoint "
                         "read)", self.cfg.replica_id, before, int(self.train_state.step))

        return heal

    def begin_step(self) -> None:
        """Join this step's quorum (healing first if this group is behind), then take its slice of the step's data."""
        self.manager.start_quorum()
        n = max(self.manager.num_participants(), 1)
        q = self.manager.participating_rank() or 0
        quorum_id = self.manager._quorum_id  # torchft's quorum id: every member sees it change together
        if quorum_id != self._quorum_id and self.manager.errored() is None:
            self._quorum_id = quorum_id
            self._announce()
        self.participants = n
        self.loader.place(q * self.dp_degree + self.dp_rank, n * self.dp_degree)
        self._position = self.loader.position

    def _announce(self) -> None:
        """One line when groups leave or join: which ones, and how many now train (a recovery event, not a step)."""
        slots = torch.zeros(self.cfg.num_replica_groups, dtype=torch.float32, device=self._device)
        slots[self.cfg.replica_id] = 1.0
        self._allreduce(slots, sum_only=True)
        if self.manager.errored() is not None:
            return  # the quorum broke again: the next step announces the set it settles on
        members = [i for i, v in enumerate(slots.tolist()) if v > 0]
        if members == self.members:
            return
        left = sorted(set(self.members) - set(members))
        joined = sorted(set(members) - set(self.members)) if self.members else []
        if self.group_rank == 0:
            change = "; ".join(part for part in (f"group(s) {left} left" if left else "",
                                                 f"group(s) {joined} joined" if joined else "") if part)
            log.warning("fault tolerance: %s%d of %d replica groups training %s at step %d", f"{change}: " if change
                        else "", len(members), self.cfg.num_replica_groups, members, int(self.train_state.step) + 1)
        self.members = members

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Average every gradient shard with the same rank of the other groups (one bucket per dtype and device)."""
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                buckets.setdefault((g.dtype, g.device), []).append(g)
        for grads in buckets.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            self._allreduce(flat)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def _allreduce(self, tensor: torch.Tensor, sum_only: bool = False) -> None:
        from torch.distributed import ReduceOp

        op = ReduceOp.SUM if sum_only else ReduceOp.AVG
        staged = tensor.cpu() if self._on_host and tensor.device.type != "cpu" else tensor
        self.manager.allreduce(staged, reduce_op=op).wait()  # an error is recorded: the step will not commit
        if staged is not tensor:
            tensor.copy_(staged)

    def should_commit(self) -> bool:
        """Whether every rank of this group and the quorum completed the step; if not, its data is read again."""
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.loader.place(self.loader.dp_rank, self.loader.dp_world_size, self._position)
            if self.group_rank == 0:
                error = self.manager.errored()
                log.warning("fault tolerance: step %d not committed (%s); it runs again with the replica groups then "
                            "up", int(self.train_state.step), str(error).splitlines()[0] if error else
                            f"fewer than min_replicas = {self.cfg.min_replicas} replica groups")
        return self.committed

    def close(self) -> None:
        """Stop the manager's servers (the peers see this group leave at their next quorum)."""
        self.manager.shutdown(wait=False)

"""The key-value store every rank reaches without the collective library: meeting points, and who misses them."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta


class RanksMissing(Exception):
    """Some ranks did not reach a meeting point before the deadline."""

    def __init__(self, where: str, missing: list[int], arrived_all: bool = False) -> None:
        self.where, self.missing, self.arrived_all = where, missing, arrived_all
        if arrived_all:
            text = (f"{where}: every rank arrived but the collective did not complete -- the transport between "
                    "nodes is broken (check *_SOCKET_IFNAME / HCCL_IF_IP, RoCE/IB links, firewall)")
        else:
            text = f"{where}: rank(s) {', '.join(map(str, missing))} did not answer"
        super().__init__(text)


def open_side_channel(rank: int, world_size: int, timeout_s: float):
    """A key-value store every rank reaches without the collective library: torchrun's agent store, or rank 0's."""
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    try:
        if agent or rank != 0:
            store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        else:
            # Without torchrun's agent, rank 0 hosts the store and must not wait for the others to connect: a rank
            # that never comes is exactly what this check reports.
            store = dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    except Exception as e:
        host = "the torchrun agent" if agent else "rank 0"
        raise RanksMissing(f"store at {addr}:{port} ({host}) unreachable from rank {rank} ({type(e).__name__})",
                           [0] if not agent else []) from e
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"titan-doctor/{run}/{attempt}/", store)


def wait_for_keys(store, keys_by_rank: dict[int, str], deadline: float) -> list[int]:
    """Poll until every rank's key exists or the deadline passes; returns the ranks whose key is missing."""
    missing = dict(keys_by_rank)
    while missing:
        for r, key in list(missing.items()):
            if store.check([key]):
                del missing[r]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return sorted(missing)


def check_in(store, rank: int, world_size: int, payload: dict, timeout_s: float) -> dict[int, dict]:
    """Each rank announces itself; returns every rank's payload or raises RanksMissing naming the absent ranks."""
    store.set(f"checkin/{rank}", json.dumps(payload))
    missing = wait_for_keys(store, {r: f"checkin/{r}" for r in range(world_size)}, time.monotonic() + timeout_s)
    if missing:
        raise RanksMissing(f"check-in within {timeout_s:.0f}s", missing)
    return {r: json.loads(store.get(f"checkin/{r}")) for r in range(world_size)}


def leave(store, rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 0 may host the store: it leaves only after the others are done with it."""
    store.set(f"done/{rank}", "1")
    if rank == 0:
        wait_for_keys(store, {r: f"done/{r}" for r in range(world_size)}, time.monotonic() + timeout_s)

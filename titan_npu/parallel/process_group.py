"""Process-group set-up from torchrun's environment, with timeouts from [comm] and errors a person can act on."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan_npu.device.detect import DeviceInfo
from titan_npu.device.env import init_failure_message
from titan_npu.errors import DeviceError, TitanError

if TYPE_CHECKING:
    from titan_npu.config.schema import CommConfig


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables; (0, 0, 1) when launched plainly."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_process_group(device: DeviceInfo, comm: CommConfig) -> tuple[int, int]:
    """Join the job's default process group when WORLD_SIZE > 1; returns (rank, world_size)."""
    rank, _, world_size = world_info()
    if world_size == 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise DeviceError(f"WORLD_SIZE={world_size} but {var} is not set; launch with torchrun (it sets it)")
    backend = device.backend
    if device.type != "cpu" and backend not in ("gloo",):
        backend = f"cpu:gloo,{device.type}:{backend}"  # gloo beside the device backend for host-side collectives
    failure = {"rank": rank, "backend": device.backend, "device_type": device.type,
               "master_addr": os.environ["MASTER_ADDR"], "master_port": os.environ["MASTER_PORT"],
               "init_timeout_s": comm.init_timeout_s}
    try:
        store = job_store(rank, world_size, comm.init_timeout_s)
    except Exception as e:
        raise DeviceError(init_failure_message(e, **failure)) from e
    announce_process(store, rank)
    wait_for_ranks(store, rank, world_size, comm.join_timeout_s)
    _remember_node_peers(store, rank, world_size)
    try:
        # The init timeout bounds the backend's own connections; collectives then get their own.
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=comm.init_timeout_s),
            device_id=None if device.type == "cpu" else device.torch_device,
        )
        set_collective_timeout(dist.group.WORLD, comm.timeout_s)
    except Exception as e:
        lost = lost_rank_error(e, "before the process group formed")
        if lost is None and isinstance(e, dist.DistStoreError):  # the store answered every rank: a peer is missing
            lost = _stalled_peers_error(e, world_size, comm.init_timeout_s)
        _forget_peers()
        raise lost or DeviceError(init_failure_message(e, **failure)) from e
    return dist.get_rank(), dist.get_world_size()


def restart_attempt() -> int:
    """Which start of the job this is under torchrun: 0 first, then 1 per restart."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(value) if value.isdigit() else 0


def job_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store the process groups exchange their addresses through (reached within timeout_s), holding this
    attempt's keys only.

    torchrun keeps one store for the whole job (its static rendezvous always, c10d unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so the keys a restarted attempt would look up (each rank's gloo address
    under the group's name) still hold the previous attempt's values: the ranks read a dead peer's address. The keys
    are therefore prefixed with the restart attempt. Without torchrun's store, rank 0 hosts a new one.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        shared = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
        return dist.PrefixStore(f"titan/attempt_{restart_attempt()}", shared)
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True)


def wait_for_ranks(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank announces itself and waits for all the others; one line naming the missing ranks on timeout."""
    keys = [f"titan/joined/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        if not missing:  # every rank arrived just as the wait gave up
            return
        attempt = f" (restart attempt {restart_attempt()})" if restart_attempt() else ""
        raise DeviceError(
            f"rank(s) {', '.join(map(str, missing))} of {world_size} did not join the process group within "
            f"comm.join_timeout_s={timeout_s:g}s{attempt}; their log says why they did not start (or are still "
            "starting: raise comm.join_timeout_s)"
        ) from None


# Each rank's process (host and pid) under the job's store, so that a survivor can tell which peer of its node ended.
_PROCESS_KEY = "titan/process/{}"
_node_peers: dict[int, int] = {}  # rank -> pid of the other ranks of this node, read once the job has formed
_world = 1
LOST_RANK_WAIT_S = 3.0  # how long a survivor waits for a failing peer of its node to have ended
# What gloo, NCCL and the store say when the other end of a connection is gone.
_PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket closed",
              "connection refused", "remote process exited", "end of file", "connection reset")


def announce_process(store: dist.Store, rank: int) -> None:
    """Leave this rank's host and pid in the store (before announcing that it joined)."""
    import socket

    store.set(_PROCESS_KEY.format(rank), f"{socket.gethostname()} {os.getpid()}")


def _remember_node_peers(store: dist.Store, rank: int, world_size: int) -> None:
    """Read the pids of the other ranks on this host (torchrun numbers a node's ranks contiguously)."""
    import socket

    global _world
    _world = world_size
    _node_peers.clear()
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    first = rank - local_rank
    peers = [r for r in range(first, first + local_world) if r != rank and 0 <= r < world_size]
    if not peers:
        return
    host = socket.gethostname()
    for r, value in zip(peers, store.multi_get([_PROCESS_KEY.format(r) for r in peers])):
        name, _, pid = value.decode().rpartition(" ")
        if name == host and pid.isdigit():
            _node_peers[r] = int(pid)


def _forget_peers() -> None:
    global _world
    _world = 1
    _node_peers.clear()


def _process_ended(pid: int) -> bool:
    """Whether the process `pid` has ended (gone, or a zombie its launcher has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def lost_ranks(wait_s: float = 0.0) -> list[int]:
    """The ranks of this node whose process has ended, waiting up to `wait_s` for one to end."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        ended = sorted(r for r, pid in _node_peers.items() if _process_ended(pid))
        if ended or time.monotonic() >= deadline:
            return ended
        time.sleep(0.05)


def lost_rank_error(error: BaseException, when: str) -> DeviceError | None:
    """One line for an error that a lost peer caused (a rank of this node whose process ended, or a connection
    that its other end closed), naming the rank where it is known; None for any other error.

    The DeviceError is marked `peer_lost` when the lost rank is on this node: its launcher sees that rank end
    too, and is given the time to stop this one (cli.run_command), so that torchrun names the lost rank as the
    first failure.
    """
    if isinstance(error, TitanError) or _world == 1:
        return None
    text = str(error)
    gone = any(s in text.lower() for s in _PEER_GONE)
    if not (gone or isinstance(error, dist.DistError)):
        return None  # this rank's own error (a file, a bug): said as it is, even if a peer ended meanwhile
    ended = lost_ranks(LOST_RANK_WAIT_S)
    if ended:
        which = f"rank {ended[0]}" if len(ended) == 1 else f"ranks {', '.join(map(str, ended))}"
        lost = DeviceError(
            f"{which} of {_world} ended {when} (killed, e.g. by kill -9 or the out-of-memory killer, or it "
            "failed: its own output says why); this rank stops too. With checkpoints the same command resumes "
            "from the last one (torchrun --max-restarts N does so by itself)"
        )
        lost.peer_lost = True
        return lost
    if not gone:
        return None
    # A peer on another node: gloo names its address ("[/path/pair.cc:537] Read error [10.0.0.2]:4321: ...").
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0]) if text.strip() else type(error).__name__
    return DeviceError(
        f"a peer rank of {_world} stopped answering {when} ({detail}); its own output says why (killed, out of "
        "memory, or its node failed); with checkpoints the same command resumes from the last one"
    )


def _stalled_peers_error(error: dist.DistStoreError, world_size: int, timeout_s: float) -> DeviceError:
    """One line for ranks that reached the job's store (wait_for_ranks) but never published their backend's address:
    the store's timeout names the keys it waited for, each ending in the rank ("/0//cpu//0/1")."""
    keys = re.search(r"keys: (.*)", str(error))
    ranks = sorted({int(k) for k in re.findall(r"/(\d+)\s*(?:,|\]|$)", keys.group(1))}) if keys else []
    which = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "a peer rank"
    return DeviceError(
        f"{which} of {world_size} reached the job's store but did not join the process group within "
        f"comm.init_timeout_s={timeout_s:g}s: ended or stuck while starting (its output says why); if only slow to "
        "start, raise comm.init_timeout_s"
    )


def set_collective_timeout(group: dist.ProcessGroup, seconds: float) -> None:
    """Set the collective timeout of each backend of a group (gloo, nccl, hccl).

    ProcessGroupHCCL's watchdog aborts a collective after the group's timeout (only at the 30-minute default does
    it fall back to HCCL_EXEC_TIMEOUT + 1800 s); torch's _set_pg_timeout knows gloo and nccl only, so the hccl
    backend is set through its own binding.
    """
    backend = dist.get_backend(group)
    timeout = timedelta(seconds=seconds)
    if "gloo" in backend or "nccl" in backend:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    if "hccl" in backend:
        npu = torch.device(torch._C._get_privateuse1_backend_name())  # "npu" once torch_npu is imported
        group._get_backend(npu)._set_default_timeout(timeout)


def destroy_process_group() -> None:
    """Leave the process group if one was joined."""
    _forget_peers()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now, below the kernel's ephemeral range so gloo's own connections cannot take it."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise DeviceError(f"no free TCP port found on {host} between 20000 and 32000; free some or pass --master_port")

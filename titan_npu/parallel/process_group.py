"""Process-group set-up from torchrun's environment, with timeouts from [comm] and errors a person can act on."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan_npu.device.detect import DeviceInfo
from titan_npu.device.env import init_failure_message
from titan_npu.errors import DeviceError

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
    wait_for_ranks(store, rank, world_size, comm.join_timeout_s)
    try:
        # The init timeout bounds the backend's own connections; collectives then get their own.
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=comm.init_timeout_s),
            device_id=None if device.type == "cpu" else device.torch_device,
        )
        set_collective_timeout(dist.group.WORLD, comm.timeout_s)
    except Exception as e:
        raise DeviceError(init_failure_message(e, **failure)) from e
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

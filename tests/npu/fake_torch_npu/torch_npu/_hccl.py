"""The "hccl" process-group backend of the fake: collectives run by gloo on the CPU memory under the npu tensors.

Registered for the "npu" device when the fake device is installed (FAKE_NPU_TENSORS=1). Each group records, for
the report, the environment and the deterministic-algorithms switch when it was created, and the collective
timeout set on it (ProcessGroupHCCL's _set_default_timeout).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.utils._pytree import tree_map

timeouts: list[float] = []  # seconds, one per _set_default_timeout call


def _unwrap(x):
    return x._data if hasattr(x, "_data") else x


def _done(result) -> dist.Work:
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class ProcessGroupHCCL(dist.ProcessGroup):
    """Each collective: unwrap npu tensors to their CPU data, run gloo's collective on it, wait, return a done work."""

    supports_splitting = False  # c10d asks the device backend before creating subgroups

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("fake_hccl", store), rank, size, timeout)

    def _run(self, name: str, *args):
        args = tree_map(_unwrap, args)
        getattr(self._gloo, name)(*args).wait()
        return _done(args[0])

    def allreduce(self, tensors, opts):
        return self._run("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        return self._run("allreduce_coalesced", tensors, opts)

    def allgather(self, outputs, inputs, opts):
        return self._run("allgather", outputs, inputs, opts)

    def all_gather_single(self, output, input, opts):
        return self._run("_allgather_base", output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        for output, input in zip(outputs, inputs, strict=True):
            self._run("_allgather_base", output, input, opts)
        return _done(outputs)

    def reduce_scatter(self, outputs, inputs, opts):
        return self._run("reduce_scatter", outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts):
        return self._run("_reduce_scatter_base", output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        for output, input in zip(outputs, inputs, strict=True):
            self._run("_reduce_scatter_base", output, input, opts)
        return _done(outputs)

    def broadcast(self, tensors, opts):
        return self._run("broadcast", tensors, opts)

    def gather(self, outputs, inputs, opts):
        return self._run("gather", outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        return self._run("scatter", outputs, inputs, opts)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        return self._run("alltoall_base", output, input, output_splits, input_splits, opts)

    def barrier(self, opts):
        self._gloo.barrier(opts).wait()
        return _done(None)

    def getBackendName(self) -> str:  # noqa: N802  (the c10d name)
        return "hccl"

    # The group stands for both backends of "cpu:gloo,npu:hccl": gloo for cpu tensors, itself for npu ones.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu"), torch.device("npu")]

    def _get_backend(self, device: torch.device):
        return self._gloo if torch.device(device).type == "cpu" else self

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    def _set_default_timeout(self, timeout: timedelta) -> None:
        timeouts.append(timeout.total_seconds())


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupHCCL:
    sys.modules["torch_npu"]._record_event("hccl_init")
    return ProcessGroupHCCL(store, rank, size, timeout)


def install() -> None:
    """Register the backend for the npu device."""
    dist.Backend.register_backend("hccl", _create, devices=["npu"])

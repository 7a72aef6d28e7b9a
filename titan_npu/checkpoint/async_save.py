"""Asynchronous saves: the state is copied to host memory while training goes on, then written in the background.

The copy ("staging") runs in a background thread during the next forward and backward, which only read the
parameters; the next optimizer step, which changes them in place, first waits for it. DCP's writer thread then
writes the host copy over the checkpoint's own gloo group and publishes the checkpoint; the next save waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from titan_npu.checkpoint.group import CheckpointGroup


class AsyncSaver:
    """At most one save in flight: its snapshot, its write, and the host buffers kept for the next snapshot."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], device_type: str) -> None:
        self.device_type = device_type
        self._stager: DefaultStager | None = None  # host buffers, kept across saves: later snapshots copy into them
        self._staged_sources: list[Any] = []
        self._staging: Future | None = None  # the snapshot of the save in flight, until it is in host memory
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._published = threading.Event()
        self._published.set()
        self._publish_error: BaseException | None = None
        self.last_staging_wait_s = 0.0
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self.finish_staging)

    def start(self, state: dict[str, Any], checkpoint_id: Path, step: int, group: CheckpointGroup,
              publish: Callable[[], None]) -> None:
        """Snapshot `state` and write it to `checkpoint_id` in the background; `publish` runs once it is written."""
        self._published.clear()
        self._publish_error = None
        response = dcp.async_save(state, checkpoint_id=str(checkpoint_id), process_group=group.pg,
                                  async_stager=self._async_stager(), no_dist=not group.distributed)
        future = response
        if isinstance(response, AsyncSaveResponse):
            self._staging, future = response.staging_completion, response.upload_completion
        # The stager finds its host buffer by the source storage's Python object (weakly held): keep those
        # alive, or every save allocates (and page-faults) a fresh copy of the whole state.
        self._staged_sources = _storages(state)
        self._pending, self._pending_step = future, step
        future.add_done_callback(lambda f: self._on_done(f, publish))

    def _on_done(self, future: Future, publish: Callable[[], None]) -> None:
        # Runs in DCP's writer thread: publish there so a crash of the main process after this point keeps it.
        try:
            if future.exception() is None:
                publish()
        except BaseException as e:  # surfaced by the next wait()
            self._publish_error = e
        finally:
            self._published.set()

    def finish_staging(self, *_: Any) -> None:
        """Before an optimizer step changes the parameters in place: the async snapshot must be complete."""
        staging, self._staging = self._staging, None
        if staging is not None:
            t0 = time.perf_counter()
            try:
                staging.result()
            except Exception:  # the upload fails with it; wait() reports that
                pass
            self.last_staging_wait_s = time.perf_counter() - t0

    def wait(self) -> tuple[int, BaseException | None] | None:
        """Block until the save in flight is written and published: its step and error (None: it succeeded).

        None when no save was in flight.
        """
        future, step = self._pending, self._pending_step
        if future is None:
            return None
        self._staging = None
        self._pending = self._pending_step = None
        error: BaseException | None = None
        try:
            future.result()
        except Exception as e:
            error = e
        self._published.wait()
        if error is None and self._publish_error is not None:
            error, self._publish_error = self._publish_error, None
        return step, error

    def close(self) -> None:
        """Free the host buffers (after wait())."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
            self._staged_sources = []

    def _async_stager(self) -> DefaultStager:
        if self._stager is None:
            # The snapshot is copied in a background thread while the next forward/backward run (they only read the
            # parameters); the next optimizer step waits for it (finish_staging). Pinned host memory and a side
            # stream speed up the device-to-host copy where CUDA provides them.
            cuda = self.device_type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
        return self._stager


def _storages(obj: Any) -> list[Any]:
    """The untyped storages of every tensor in a nested state dict (a DTensor's: its local shard's)."""
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _storages(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _storages(v)]
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return [local.untyped_storage()]
    return []

"""CheckpointManager: saves and restores a whole run with torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer in their canonical, layout-independent form, the lr schedule, step and
tokens seen (all in DCP; state.py), each rank's data-loader position and RNG states (ranks/rank-R.pt;
rank_state.py), the resolved config (config.toml) and checkpoint.json, written last (storage.py). The manager is
what the trainer holds; the work is done by save.py and async_save.py (saving), resume.py (resuming) and
initial_load.py (starting from pretrained weights), over the gloo group of group.py. Rank 0 holds the lock of
checkpoint.dir for the manager's life (lock.py): one run at a time. See docs/checkpointing.md.

Saves are collective: every rank calls save()/maybe_save() at the same step. Asynchronous saves copy the state to
host memory, return, and write in a background thread over their own gloo process group (training collectives on
the default group would otherwise interleave with the checkpoint's); the next save waits for the previous one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_npu.checkpoint.group import CheckpointGroup
from titan_npu.checkpoint.initial_load import load_initial_weights
from titan_npu.checkpoint.lock import DirLock, acquire
from titan_npu.checkpoint.resume import choose_resume_target, load_checkpoint
from titan_npu.checkpoint.save import Saver
from titan_npu.checkpoint.state import RunState, Stateful
from titan_npu.config.schema import JobConfig


class CheckpointManager:
    """Save / resume a run: model, optimizer, lr schedule, data position, RNG, step; async, atomic, rotated.

    train_state is any object with integer attributes `step` and `tokens_seen` (the Trainer): save() reads them,
    load() sets them. `extra` names further global Stateful objects (e.g. a loss scaler) to save and restore.
    """

    def __init__(
        self,
        job: JobConfig,
        model_parts: list[nn.Module],
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
        lr_scheduler: Stateful | None,
        dataloader: Stateful | None,
        train_state: Any,
        *,
        dp_rank: int = 0,
        dp_degree: int = 1,
        device_type: str = "cpu",
        model_args: Any = None,
        layout: str = "",
        extra: dict[str, Stateful] | None = None,
    ) -> None:
        self.job = job
        self.cfg = job.checkpoint
        self.root = Path(self.cfg.dir)
        self.run = RunState(
            list(model_parts), list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers],
            lr_scheduler, dataloader, train_state, dict(extra or {}),
            dp_rank=dp_rank, dp_degree=dp_degree, device_type=device_type,
        )
        self.model_args = model_args
        self.layout = layout
        self.enabled = bool(self.cfg.enable)
        self.group = CheckpointGroup(job.comm.timeout_s)
        # One run at a time owns checkpoint.dir (rank 0 holds its lock for the run's life; lock.py).
        self._lock: DirLock | None = None
        if self.enabled:
            self.group.agree(self._take_lock, self.root)
        ranks = self.group.all_gather({"dp_rank": dp_rank, "dp_degree": dp_degree})
        self._saver = Saver(job, self.group, self.run, model_args=model_args, layout=layout, ranks=ranks)

    @property
    def last_save_blocking_s(self) -> float:
        """How long the last save held the training loop."""
        return self._saver.last_save_blocking_s

    @property
    def last_staging_wait_s(self) -> float:
        """How long the last optimizer step waited for an async save's snapshot to reach host memory."""
        return self._saver.background.last_staging_wait_s

    @last_staging_wait_s.setter
    def last_staging_wait_s(self, seconds: float) -> None:
        self._saver.background.last_staging_wait_s = seconds

    def _take_lock(self) -> None:
        self._lock = acquire(self.root)

    def release_lock(self) -> None:
        """Give up checkpoint.dir (rank 0's lock); the run's end, or a refusal before it starts, does it."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ---------------------------------------------------------------- resume

    def load(self) -> bool:
        """Resume per checkpoint.resume, else start from checkpoint.initial_load if set; True if a checkpoint loaded.

        Collective: every rank calls it. Sets train_state.step / tokens_seen from the checkpoint.
        """
        try:
            target = None
            if self.enabled:
                target, self._saver.stale_above = self.group.agree(lambda: choose_resume_target(self.cfg), self.root)
            if target is not None:
                # resume=auto chose it for its files' digests; a step or path the user named is checked as it loads.
                self.load_checkpoint(target, verified=str(self.cfg.resume).strip() == "auto")
                return True
            if self.cfg.initial_load:
                load_initial_weights(self.run.model_parts, self.cfg.initial_load, self.model_args,
                                     model_only=self.cfg.initial_load_model_only, manager=self)
            return False
        except BaseException:
            self.release_lock()  # a refused resume leaves the directory as it found it
            raise

    def load_checkpoint(self, path: str | Path, sections: tuple[str, ...] | None = None,
                        verified: bool = False) -> None:
        """Restore the run from one checkpoint directory (collective).

        sections=None restores everything (resume); ("model",) or ("model", "optimizer") start a new run from it.
        verified: its files were already checked against checkpoint.json (by choose_resume_target).
        """
        load_checkpoint(path, self.job, self.run, self.group, model_args=self.model_args, layout=self.layout,
                        sections=sections, verified=verified)
        if sections is None:
            self._saver.last_saved_step = self.run.train_state.step

    # ---------------------------------------------------------------- save

    def maybe_save(self, step: int, last_step: bool = False) -> bool:
        """Save at every save_interval-th step (async if configured) and always, synchronously, at the last step."""
        if not self.enabled:
            return False
        if last_step:
            self.save(step, sync=True)
            return True
        if step % self.cfg.save_interval == 0:
            self.save(step, sync=not self.cfg.async_save)
            return True
        return False

    def save(self, step: int | None = None, sync: bool = True) -> None:
        """Save the run at `step` (default: train_state.step); collective. sync=True returns once it is published.

        Safe to call from a SIGTERM path between steps: it first waits for an async save in flight, and a step
        already saved is not written twice.
        """
        if not self.enabled:
            return
        self._saver.save(int(self.run.train_state.step if step is None else step), sync)

    def wait(self) -> None:
        """Block until an async save in flight is written and published; raise if it failed (collective)."""
        self._saver.wait()

    def close(self) -> None:
        """Finish an async save in flight (call before the process group goes away) and free its host buffers."""
        try:
            self._saver.close()
        finally:
            self.release_lock()

"""What the Trainer calls: the step guard, the preemption handler, the watchdog and failed-save handling behind a
few methods.

Nothing here reads a device value inside a step. Per step the ranks agree on signals over a gloo group of their own
(one host-side gather of one number per rank, which never waits for the device), and the numerics guard turns the
step's loss and grad_norm into a skip flag on the device, which a fused optimizer obeys without a host read. The
flags are counted, logged and checked against reliability.max_skipped_steps when the numbers are read anyway: at
log steps and before a checkpoint is saved. Two settings need the numbers on the host before the update, one read
per step: the spike policy (spike_skip_sigma > 0) and an optimizer without a fused kernel (skip.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan_npu.config.schema import JobConfig
from titan_npu.errors import CheckpointError
from titan_npu.parallel.reduce import plain_tensor
from titan_npu.reliability.dirs import check_output_folders
from titan_npu.reliability.guards import StepGuard, TrainingHalted
from titan_npu.reliability.preemption import PreemptionHandler
from titan_npu.reliability.preflight import preflight
from titan_npu.reliability.watchdog import Watchdog, enable_flight_recorder

log = logging.getLogger("titan_npu")

SAVE_RETRY_DELAYS_S = (5.0, 30.0)  # a failed checkpoint save is tried again after these pauses, then the run stops


def prepare_reliability(cfg: JobConfig, device_type: str) -> None:
    """Before the process group exists: refuse unusable settings and output folders, switch the flight recorder on."""
    preflight(cfg, device_type)
    check_output_folders(cfg)
    if cfg.reliability.watchdog:
        enable_flight_recorder(cfg.reliability.flight_recorder_size, device_type)


class Reliability:
    """The run's reliability layer; build it on every rank at the same point (it creates a process group)."""

    def __init__(self, cfg: JobConfig, rank: int, world_size: int, device_type: str,
                 scaler_handles_overflow: bool = False, device_flag: bool = True) -> None:
        r = cfg.reliability
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.guard = StepGuard(r.skip_nonfinite, r.max_skipped_steps, r.spike_skip_sigma, cfg.metrics.spike_window,
                               scaler_handles_overflow, verbose=rank == 0)
        # Skips decided on the device and counted later, unless the optimizer or the spike policy needs the host.
        self.deferred = self.guard.active and device_flag and r.spike_skip_sigma == 0
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, [this rank's loss, grad_norm]) not yet counted
        self.signals = PreemptionHandler() if r.handle_signals else None
        self.watchdog = None
        if r.watchdog:
            self.watchdog = Watchdog(r.watchdog_timeout_s or cfg.comm.timeout_s, r.watchdog_step_factor,
                                     Path(cfg.metrics.log_dir) / "watchdog", rank, device_type)
        self.save_hooks: list[Callable[[int], None]] = []  # called with the step while its checkpoint is written
        self._group = None
        if world_size > 1 and (self.guard.active or self.signals is not None):
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.comm.timeout_s))
        self.step = 0
        self.preempted: tuple[int, int] | None = None  # (signal number, first rank that received it)
        self.failed_saves = 0
        self._loop = (0, 0)  # (thread, frame) of the training loop, set by start()

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        """Called by the training loop before its first step: take over SIGTERM/SIGINT and start the watchdog.

        Both stand down by themselves once the calling function has returned or raised, should finish() be missed
        (a loop that raised inside a long-lived process must not be judged a hang, nor keep the signals).
        """
        loop = sys._getframe(1)
        self._loop = (threading.get_ident(), id(loop))
        del loop  # only its identity is kept, not the frame and everything it references
        if self.signals is not None:
            self.signals.loop_running = self._loop_running
            self.signals.install()
        if self.watchdog is not None:
            self.watchdog.loop_running = self._loop_running
            self.watchdog.start()

    def _loop_running(self) -> bool:
        thread_id, frame_id = self._loop
        frame = sys._current_frames().get(thread_id)
        while frame is not None:
            if id(frame) == frame_id:
                return True
            frame = frame.f_back
        return False

    def finish(self) -> None:
        """After the loop, or on the way out of an error: stop the watchdog, give the signals back (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.signals is not None:
            self.signals.uninstall()

    def begin_step(self, step: int) -> None:
        """Step `step` starts now."""
        self.step = step
        if self.watchdog is not None:
            self.watchdog.beat(f"step {step}")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Something other than a step (a save, a validation): timed against the base limit, not step times."""
        if self.watchdog is not None:
            self.watchdog.beat(f"{name} at step {self.step}", step=False)
        yield

    def check_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | bool:
        """Collective, between the gradients and the optimizer step: whether to skip this step's update.

        Deferred, without a loss scaler: a 0-d float flag on the device (1.0 = skip), identical on every rank, for
        skip.step_unless. Otherwise a bool: decided on the host, or False where the scaler's own flag decides.
        """
        self._agree_on_signals()
        if not self.guard.active:
            return False
        loss = plain_tensor(loss.detach()).float().reshape(())
        grad_norm = plain_tensor(grad_norm.detach()).float().reshape(())
        if not self.deferred:
            return not self._decide_now(step, loss, grad_norm)
        self._pending.append((step, torch.stack([loss, grad_norm])))
        if self.guard.scaler_handles_overflow:
            # A non-finite loss has non-finite gradients, which the scaler finds and skips (and backs off from).
            return False
        bad = (~torch.isfinite(loss)).float()
        if self.world_size > 1:  # one rank's non-finite loss skips every rank's update
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return torch.maximum(bad, (~torch.isfinite(grad_norm)).float())

    def _agree_on_signals(self) -> None:
        """Every rank learns of a signal on any rank: a gather of host values only (nothing waits for the device)."""
        if self.signals is None:
            return
        received = np.array([self.signals.signum] * self.world_size, dtype=np.float64)
        if self._group is not None:  # gathered straight into `received`, read as numbers, not as tensors
            rows = [torch.from_numpy(received[r:r + 1]) for r in range(self.world_size)]
            dist.all_gather(rows, torch.tensor([float(self.signals.signum)], dtype=torch.float64), group=self._group)
        flagged = np.flatnonzero(received > 0)
        if self.preempted is None and flagged.size:
            self.preempted = (int(received[flagged[0]]), int(flagged[0]))

    def _gather_losses(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's row of `mine` (host float64, one row per rank), over the gloo group."""
        if self._group is None:
            return mine.unsqueeze(0)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self._group)
        return torch.stack(rows)

    def _decide_now(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Read this step's numbers (one host synchronisation) and decide at once: True to apply the update."""
        table = self._gather_losses(torch.stack([loss, grad_norm]).double().cpu())
        return self.guard.decide(step, table[:, 0].tolist(), float(table[:, 1].max())).apply

    def settle(self) -> None:
        """Collective: read the deferred steps' numbers (one host read) and count their skips, in step order.

        The guard's verdicts repeat the flags the device acted on (the same rule on the same numbers).
        """
        if not self._pending:
            return
        steps = [step for step, _ in self._pending]
        mine = torch.stack([pair for _, pair in self._pending]).double().cpu()  # (steps, [loss, grad_norm])
        self._pending = []
        table = self._gather_losses(mine.reshape(-1)).reshape(-1, len(steps), 2)  # (ranks, steps, 2)
        for i, step in enumerate(steps):
            self.guard.decide(step, table[:, i, 0].tolist(), float(table[:, i, 1].max()))

    @property
    def stop_requested(self) -> bool:
        """True when the loop must end after this step (a signal on some rank, or too many skipped updates)."""
        return self.preempted is not None or bool(self.guard.halt_message)

    # ------------------------------------------------------------------ checkpoints

    def maybe_save(self, checkpointer: Any, step: int, last_step: bool) -> None:
        """checkpointer.maybe_save, retried after a failure; CheckpointError (the run stops) when every try failed."""
        c = self.cfg.checkpoint
        if c.enable and (last_step or step % c.save_interval == 0):
            self.settle()  # the checkpoint keeps the guard's counters up to this step
        self._save_with_retries(lambda: checkpointer.maybe_save(step, last_step=last_step), step)

    def _save_with_retries(self, save: Callable[[], Any], step: int) -> None:
        """Call `save` (collective: every rank fails or succeeds together) until it succeeds or the tries run out."""
        for attempt, delay in enumerate((*SAVE_RETRY_DELAYS_S, None), start=1):
            try:
                with self.phase("checkpoint save"):
                    save()
                return
            except CheckpointError as e:
                if delay is None:
                    raise CheckpointError(
                        f"{e}; tried {attempt} times: the run stops at step {step} rather than train on without "
                        "checkpoints"
                    ) from e
                if self.rank == 0:
                    log.error("checkpoint: %s -- trying again in %.0fs (try %d of %d)", e, delay, attempt + 1,
                              len(SAVE_RETRY_DELAYS_S) + 1)
                time.sleep(delay)

    def stop(self, checkpointer: Any, step: int) -> None:
        """End the run at `step`: save synchronously, then return (signal) or raise TrainingHalted (numerics)."""
        self.settle()
        halt = self.guard.halt_message
        self._save_with_retries(lambda: checkpointer.save(step, sync=True), step)
        where = self._where(step)
        if halt:
            raise TrainingHalted(
                f"{halt}; the weights of step {self.guard.last_applied_step} (the last update applied) are {where}; "
                f"lower optimizer.lr or look at the data of these steps, then {self._again()}"
            )
        if self.rank == 0 and self.preempted is not None and step < self.cfg.training.max_steps:
            signum, rank = self.preempted
            log.warning("preempted by %s on rank %d after step %d: the run is %s; %s",
                        signal.Signals(signum).name, rank, step, where, self._again())

    def _again(self) -> str:
        """What running the same command again does: resume, or (no checkpoints) start over."""
        if self.cfg.checkpoint.enable:
            return "run the same command to resume"
        return "the same command starts the run over from step 1 (checkpoint.enable = true keeps the progress)"

    def _where(self, step: int) -> str:
        c = self.cfg.checkpoint
        if not c.enable:
            return "not saved (checkpoint.enable = false)"
        path = Path(c.dir) / f"step-{step}"
        how = "" if c.resume == "auto" else f" (pass --checkpoint.resume {path})"
        return f"saved in {path}{how}"

    # ------------------------------------------------------------------ Stateful (saved with every checkpoint)

    def state_dict(self) -> dict[str, Any]:
        for hook in self.save_hooks:
            hook(self.step)
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)

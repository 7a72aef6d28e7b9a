"""Saving a checkpoint: collective, atomic, rotated; synchronous, or written in the background (async_save.py).

Every rank calls save() at the same step. The state goes into step-N.tmp (DCP, ranks/rank-R.pt, config.toml);
rank 0 then publishes it as step-N with checkpoint.json written last (storage.py) and drops the oldest beyond
checkpoint.keep_last_n. A failure on any rank fails the save on every rank, and the previous checkpoints stay.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.async_save import AsyncSaver
from titan_npu.checkpoint.free_space import check_free_space
from titan_npu.checkpoint.group import CheckpointGroup
from titan_npu.checkpoint.rank_state import write_rank_state
from titan_npu.checkpoint.state import RunState
from titan_npu.config.loader import save_config
from titan_npu.config.schema import JobConfig
from titan_npu.errors import CheckpointError
from titan_npu.lora.names import lora_record

log = logging.getLogger("titan_npu")


class Saver:
    """Writes the run's checkpoints into checkpoint.dir; at most one async save is in flight."""

    def __init__(self, job: JobConfig, group: CheckpointGroup, run: RunState, *, model_args: Any, layout: str,
                 ranks: list[dict[str, int]]) -> None:
        self.job = job
        self.cfg = job.checkpoint
        self.root = Path(self.cfg.dir)
        self.group = group
        self.run = run
        self.model_args = model_args
        self.layout = layout
        self.ranks = ranks  # every rank's data-parallel coordinates, for a resume under another layout
        self.background = AsyncSaver(run.optimizers, run.device_type)
        self.last_saved_step: int | None = None
        # With checkpoint.overwrite: checkpoints of a previous run above this step are replaced by this run's.
        self.stale_above: int | None = None
        self.last_save_blocking_s = 0.0

    def save(self, step: int, sync: bool) -> None:
        """Save the run at `step` (collective); sync=True returns once it is published."""
        rank = self.group.rank
        t0 = time.perf_counter()
        try:
            self.wait()
        except CheckpointError as e:
            # The previous checkpoint is lost, not this one: report it and save now (the previous one stays intact).
            if rank == 0:
                log.error("checkpoint: %s", e)
        if step == self.last_saved_step:
            return
        # Refuse before writing anything when the disk cannot hold one more checkpoint; the older ones stay.
        check_free_space(self.root, self.run.model_parts, self.run.optimizers, self.job.reliability.disk_margin,
                         self.group.pg)
        tmp = storage.tmp_path(self.root, step)
        error = None
        if rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        self._raise_if_any_failed(step, error)  # also the barrier: the directory exists for every rank after it
        state = self.run.state_dict(for_load=False)
        state["train_state"]["step"] = step  # the step named, even when train_state lags (e.g. a signal path)
        try:
            write_rank_state(tmp, rank, self.run.rank_state(rank))
            if rank == 0:
                save_config(self.job, tmp / storage.CONFIG_FILE)
        except Exception as e:
            error = e
        self._raise_if_any_failed(step, error)
        info = self._info(step, sync)
        if sync:
            error = None
            try:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group.pg, no_dist=not self.group.distributed)
                self._publish(step, tmp, info, t0)
            except Exception as e:
                error = e
            self._raise_if_any_failed(step, error)
            self.last_save_blocking_s = time.perf_counter() - t0
        else:
            self.background.start(state, tmp, step, self.group, lambda: self._publish(step, tmp, info, t0))
            self.last_save_blocking_s = time.perf_counter() - t0
            if rank == 0:
                log.info("checkpoint: step %d is being copied to host memory and written in the background "
                         "(the loop waited %.2fs)", step, self.last_save_blocking_s)
        self.last_saved_step = step

    def wait(self) -> None:
        """Block until an async save in flight is written and published; raise if it failed (collective)."""
        outcome = self.background.wait()
        if outcome is not None:
            self._raise_if_any_failed(*outcome)

    def close(self) -> None:
        """Finish an async save in flight and free its host buffers."""
        try:
            self.wait()
        finally:
            self.background.close()

    def _publish(self, step: int, tmp: Path, info: dict[str, Any], t0: float) -> None:
        if self.group.rank != 0:
            return
        final = self.root / storage.checkpoint_name(step)
        storage.publish(tmp, final, info)
        dropped = []
        if self.stale_above is not None:
            for ref in storage.list_checkpoints(self.root):
                if ref.step > self.stale_above and ref.step != step:
                    storage.remove_checkpoint(ref.path)
                    dropped.append(ref.step)
            self.stale_above = None
        dropped += storage.rotate(self.root, self.cfg.keep_last_n)
        size_gb = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 1e9
        log.info("checkpoint: saved step %d to %s (%.2f GB, %.1fs)%s", step, final, size_gb,
                 time.perf_counter() - t0, f"; removed steps {dropped}" if dropped else "")

    def _raise_if_any_failed(self, step: int, error: BaseException | None) -> None:
        """Share every rank's outcome of a save, so that all raise together rather than some hanging."""
        failure = self.group.first_failure(error)
        if failure is None:
            return
        self._discard(step)
        rank, reason = failure
        raise CheckpointError(
            f"checkpoint of step {step} failed on rank {rank} ({reason}); check free space and write permission in "
            f"{self.root}; {storage.latest_checkpoint_note(self.root)}"
        ) from error

    def _discard(self, step: int) -> None:
        if self.group.rank == 0:
            shutil.rmtree(storage.tmp_path(self.root, step), ignore_errors=True)
        if self.last_saved_step == step:
            self.last_saved_step = None

    def _info(self, step: int, sync: bool) -> dict[str, Any]:
        args = self.model_args
        return {
            "step": step,
            "tokens_seen": int(self.run.train_state.tokens_seen),
            "world_size": self.group.world_size,
            "layout": self.layout,
            "ranks": self.ranks,
            "model_args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None,
            "export_dtype": self.cfg.export_dtype,
            "optimizer_state_dtype": self.job.optimizer.state_dtype,
            "tokenizer": _tokenizer_path(self.job.data.tokenizer),
            "lora": lora_record(self.job.lora),  # what export --format peft writes into adapter_config.json
            "async": not sync,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
        }


def _tokenizer_path(spec: str) -> str:
    """data.tokenizer as export finds it later: an absolute path for a file or directory, else the name ("byte")."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec

"""CheckpointManager: saves and restores a whole run with torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer in their canonical, layout-independent form (get_state_dict: FQN keys,
full shapes, whatever FSDP/TP sharding produced them), the lr schedule, step and tokens seen (all in DCP), each
rank's data-loader position and RNG states (ranks/rank-R.pt), the resolved config (config.toml) and
checkpoint.json, written last. See storage.py for the atomic publishing and docs/checkpointing.md for recipes.

Saves are collective: every rank calls save()/maybe_save() at the same step. Asynchronous saves copy the state to
host memory, return, and write in a background thread over their own gloo process group (training collectives on
the default group would otherwise interleave with the checkpoint's); the next save waits for the previous one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    checkpoint_entries,
    expected_entries,
    read_metadata,
)
from titan_npu.checkpoint.fit import describe_mismatch
from titan_npu.checkpoint.rank_state import (
    capture_rng,
    pick_source_rank,
    read_rank_state,
    restore_rng,
    write_rank_state,
)
from titan_npu.config.schema import JobConfig
from titan_npu.errors import CheckpointError
from titan_npu.reliability.disk import check_free_space

log = logging.getLogger("titan_npu")

# Flattened optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") is keyed by parameter name only, so
# it merges across pipeline stages and loads under any layout.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Config sections whose change makes a resumed run differ from an uninterrupted one (the layout may change freely).
_RESUME_SENSITIVE = ("model", "training", "optimizer", "lr_scheduler", "data")
_RESUME_NEUTRAL = ("num_workers",)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


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
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if len(self.optimizers) not in (1, len(self.model_parts)) or (
            len(self.optimizers) == 1 and len(self.model_parts) > 1
        ):
            raise CheckpointError(
                f"{len(self.model_parts)} model parts with {len(self.optimizers)} optimizers: checkpointing needs "
                "one optimizer per model part"
            )
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.train_state = train_state
        self.extra = dict(extra or {})
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.device_type = device_type
        self.model_args = model_args
        self.layout = layout
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.enabled = bool(self.cfg.enable)

        # DCP's own group: gloo (host-side, works beside hccl/nccl), used by saves, loads and our decisions alike.
        self._pg = None
        if self.distributed and self.world_size > 1:
            from datetime import timedelta

            self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=job.comm.timeout_s))
        self._ranks = self._gather_dp_coordinates()

        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._published = threading.Event()
        self._published.set()
        self._publish_error: BaseException | None = None
        self._last_saved_step: int | None = None
        self._stager = None  # host buffers of async saves, kept across saves: later snapshots only copy into them
        self._staged_sources: list[Any] = []
        self._staging: Future | None = None  # the snapshot of an async save, until it is in host memory
        self.last_staging_wait_s = 0.0
        for optimizer in self.optimizers:
            optimizer.register_step_pre_hook(self._finish_staging)
        # With checkpoint.overwrite: checkpoints of a previous run above this step are replaced by this run's.
        self._stale_above: int | None = None
        self.last_save_blocking_s = 0.0

    # ---------------------------------------------------------------- resume

    def load(self) -> bool:
        """Resume per checkpoint.resume, else start from checkpoint.initial_load if set; True if a checkpoint loaded.

        Collective: every rank calls it. Sets train_state.step / tokens_seen from the checkpoint.
        """
        target = self._agree(self._choose_resume_target) if self.enabled else None
        if target is not None:
            self.load_checkpoint(target)
            return True
        if self.cfg.initial_load:
            from titan_npu.checkpoint.initial_load import load_initial_weights

            load_initial_weights(self.model_parts, self.cfg.initial_load, self.model_args,
                                 model_only=self.cfg.initial_load_model_only, manager=self)
        return False

    def _choose_resume_target(self) -> str | None:
        """Rank 0's decision: which checkpoint to resume from (None = start fresh); raises on a conflict."""
        resume = str(self.cfg.resume).strip()
        existing = storage.list_checkpoints(self.root)
        storage.clean_unfinished(self.root)
        if resume == "never":
            if existing and not self.cfg.overwrite:
                raise CheckpointError(
                    f"checkpoint.dir={self.root} already holds checkpoints (latest step {existing[-1].step}) and "
                    "checkpoint.resume=never; set checkpoint.resume=auto to continue that run, "
                    "checkpoint.overwrite=true to replace it, or choose another checkpoint.dir"
                )
            self._stale_above = -1 if existing else None
            return None
        if resume == "auto":
            return str(existing[-1].path) if existing else None
        ref = storage.resolve_checkpoint(resume, self.root)
        later = [c.step for c in existing if c.step > ref.step]
        if later:
            if not self.cfg.overwrite:
                raise CheckpointError(
                    f"checkpoint.resume={resume} picks step {ref.step} but {self.root} holds later checkpoints "
                    f"(steps {', '.join(map(str, later))}) that this run would overwrite; set "
                    "checkpoint.overwrite=true to replace them, or checkpoint.dir to a new directory"
                )
            self._stale_above = ref.step
        return str(ref.path)

    def _agree(self, decide) -> Any:
        """Run `decide` on rank 0 and hand its result (or its error) to every rank."""
        result: list[Any] = [None]
        if self.rank == 0:
            try:
                result[0] = ("ok", decide(), self._stale_above)
            except Exception as e:  # every rank raises it, none waits for a decision that never comes
                message = str(e) if isinstance(e, CheckpointError) else f"{self.root}: {type(e).__name__}: {e}"
                result[0] = ("error", message, None)
        if self._pg is not None:
            dist.broadcast_object_list(result, src=0, group=self._pg)
        kind, value, stale = result[0]
        if kind == "error":
            raise CheckpointError(value)
        self._stale_above = stale
        return value

    def load_checkpoint(self, path: str | Path, sections: tuple[str, ...] | None = None) -> None:
        """Restore the run from one checkpoint directory (collective).

        sections=None restores everything (resume); ("model",) or ("model", "optimizer") start a new run from it.
        """
        path = Path(path)
        storage.check_checkpoint_dir(path)
        info = storage.read_info(path)
        t0 = time.perf_counter()
        state = self._state_dict(for_load=True, sections=sections)
        self._check_fits(path, state)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=self._pg, no_dist=not self.distributed)
        self._set_state(state)
        if sections is None:
            self._restore_rank_state(path, info)
            self.train_state.step = int(state["train_state"]["step"])
            self.train_state.tokens_seen = int(state["train_state"]["tokens_seen"])
            self._last_saved_step = self.train_state.step
        if self.rank == 0:
            if sections is None:
                self._warn_config_changes(path)
            what = f"step {info['step']}" if sections is None else f"{' and '.join(sections)} of step {info['step']}"
            saved_layout = info.get("layout") or ""
            changed = f" (saved under {saved_layout})" if saved_layout and saved_layout != self.layout else ""
            log.info("checkpoint: loaded %s from %s in %.1fs%s", what, path, time.perf_counter() - t0, changed)

    def _warn_config_changes(self, path: Path) -> None:
        """A resumed run follows its new config; say which settings that change the run differ from the saved."""
        from titan_npu.config.loader import config_to_dict, read_config_file

        try:
            saved = read_config_file(path / storage.CONFIG_FILE)
        except Exception:  # an unreadable or absent copy only loses this warning
            return
        now = config_to_dict(self.job)
        changed = [f"{section}.{key}: {saved[section].get(key)!r} -> {value!r}"
                   for section in _RESUME_SENSITIVE if isinstance(saved.get(section), dict)
                   for key, value in now.get(section, {}).items()
                   if key in saved[section] and saved[section][key] != value and key not in _RESUME_NEUTRAL]
        if changed:
            log.warning("checkpoint: resuming with a changed config (the run is no longer an exact continuation): %s",
                        "; ".join(changed))

    def _check_fits(self, path: Path, state: dict[str, Any]) -> None:
        """Compare what the run expects with what the checkpoint holds, before DCP reads anything.

        Extra states the checkpoint lacks are dropped from `state` (they keep their fresh values).
        """
        found = checkpoint_entries(read_metadata(path))
        expected = expected_entries(state)

        def section(prefix: str, table: dict) -> dict[str, tuple]:
            return {k[len(prefix):]: (v[1] if v[0] == "tensor" else ()) for k, v in table.items()
                    if k.startswith(prefix)}

        # The whole model, not this rank's pipeline stage: a checkpoint holds every stage.
        model_expected = self._full_model_shapes() or section("model.", expected)
        problem = describe_mismatch(model_expected, section("model.", found))
        if problem:
            raise CheckpointError(f"checkpoint {path} does not fit the model: {problem}")
        if "optimizer" in state:
            exp_opt = {k: v for k, v in section("optimizer.", expected).items() if k.startswith("state.")}
            got_opt = {k: v for k, v in section("optimizer.", found).items() if k.startswith("state.")}
            # Entries of other stages' parameters are not this rank's concern.
            stage_params = {k.rsplit(".", 1)[0] for k in exp_opt}
            got_opt = {k: v for k, v in got_opt.items() if k.rsplit(".", 1)[0] in stage_params}
            problem = describe_mismatch(exp_opt, got_opt)
            if problem:
                raise CheckpointError(
                    f"optimizer state in {path} does not fit this optimizer ({self.job.optimizer.name}): "
                    f"{problem.split(' -- ')[0]} -- likely optimizer.name changed since the save; keep it, or start "
                    f"from the weights alone with checkpoint.initial_load={path} and checkpoint.resume=never"
                )
        for key in ("lr_scheduler", "train_state"):
            if key in state and not any(k.startswith(f"{key}.") for k in found):
                raise CheckpointError(f"checkpoint {path} has no '{key}' state; it was not written by the trainer, "
                                      f"start from its weights with checkpoint.initial_load={path}")
        for key in self.extra:
            # State added to the trainer after the checkpoint was written starts fresh instead of refusing it.
            if key in state and not any(k.startswith(f"{key}.") for k in found):
                state.pop(key)
                if self.rank == 0:
                    log.warning("checkpoint: %s holds no '%s' state; it starts fresh", path, key)

    def _full_model_shapes(self) -> dict[str, tuple[int, ...]] | None:
        if self.model_args is None:
            return None
        from titan_npu.checkpoint.initial_load import full_model_shapes

        return {k: tuple(v) for k, v in full_model_shapes(self.model_args).items()}

    def _restore_rank_state(self, path: Path, info: dict[str, Any]) -> None:
        saved = info.get("ranks") or [{"dp_rank": 0, "dp_degree": 1}]
        source = pick_source_rank(saved, self.rank, self.dp_rank, self.dp_degree)
        state = read_rank_state(path, source)
        if self.dataloader is not None and state.get("dataloader") is not None:
            reshard = saved[source]["dp_degree"] != self.dp_degree
            if reshard and self.rank == 0:
                log.warning("checkpoint: data-parallel size changed %d -> %d; the data continues at the same global "
                            "position with the new split", saved[source]["dp_degree"], self.dp_degree)
            if reshard:
                self.dataloader.load_state_dict(state["dataloader"], allow_reshard=True)
            else:
                self.dataloader.load_state_dict(state["dataloader"])
        if state.get("rng") is not None:
            restore_rng(state["rng"], self.device_type)

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
        step = int(self.train_state.step if step is None else step)
        t0 = time.perf_counter()
        try:
            self.wait()
        except CheckpointError as e:
            # The previous checkpoint is lost, not this one: report it and save now (the previous one stays intact).
            if self.rank == 0:
                log.error("checkpoint: %s", e)
        if step == self._last_saved_step:
            return
        # Refuse before writing anything when the disk cannot hold one more checkpoint; the older ones stay.
        check_free_space(self.root, self.model_parts, self.optimizers, self.job.reliability.disk_margin, self._pg)
        tmp = storage.tmp_path(self.root, step)
        error = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    import shutil

                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        self._raise_if_any_failed(step, error)  # also the barrier: the directory exists for every rank after it
        state = self._state_dict(for_load=False)
        state["train_state"]["step"] = step  # the step named, even when train_state lags (e.g. a signal path)
        try:
            write_rank_state(tmp, self.rank, {
                "rank": self.rank, "dp_rank": self.dp_rank, "dp_degree": self.dp_degree,
                "dataloader": self.dataloader.state_dict() if self.dataloader is not None else None,
                "rng": capture_rng(self.device_type),
            })
            if self.rank == 0:
                from titan_npu.config.loader import save_config

                save_config(self.job, tmp / storage.CONFIG_FILE)
        except Exception as e:
            error = e
        self._raise_if_any_failed(step, error)
        info = self._info(step, state, sync)
        self._published.clear()
        self._publish_error = None
        if sync:
            error = None
            try:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self._pg, no_dist=not self.distributed)
                self._publish(step, tmp, info, t0)
            except Exception as e:
                error = e
            finally:
                self._published.set()
            self._raise_if_any_failed(step, error)
            self.last_save_blocking_s = time.perf_counter() - t0
        else:
            response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg,
                                      async_stager=self._async_stager(), no_dist=not self.distributed)
            future = response
            if isinstance(response, AsyncSaveResponse):
                self._staging, future = response.staging_completion, response.upload_completion
            # The stager finds its host buffer by the source storage's Python object (weakly held): keep those
            # alive, or every save allocates (and page-faults) a fresh copy of the whole state.
            self._staged_sources = _storages(state)
            self._pending, self._pending_step = future, step
            future.add_done_callback(lambda f: self._on_async_done(f, step, tmp, info, t0))
            self.last_save_blocking_s = time.perf_counter() - t0
            if self.rank == 0:
                log.info("checkpoint: step %d is being copied to host memory and written in the background "
                         "(the loop waited %.2fs)", step, self.last_save_blocking_s)
        self._last_saved_step = step

    def _on_async_done(self, future: Future, step: int, tmp: Path, info: dict[str, Any], t0: float) -> None:
        # Runs in DCP's writer thread: publish there so a crash of the main process after this point keeps it.
        try:
            if future.exception() is None:
                self._publish(step, tmp, info, t0)
        except BaseException as e:  # surfaced by the next wait()
            self._publish_error = e
        finally:
            self._published.set()

    def _publish(self, step: int, tmp: Path, info: dict[str, Any], t0: float) -> None:
        if self.rank != 0:
            return
        final = self.root / storage.checkpoint_name(step)
        storage.publish(tmp, final, info)
        dropped = []
        if self._stale_above is not None:
            for ref in storage.list_checkpoints(self.root):
                if ref.step > self._stale_above and ref.step != step:
                    storage.remove_checkpoint(ref.path)
                    dropped.append(ref.step)
            self._stale_above = None
        dropped += storage.rotate(self.root, self.cfg.keep_last_n)
        size_gb = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 1e9
        log.info("checkpoint: saved step %d to %s (%.2f GB, %.1fs)%s", step, final, size_gb,
                 time.perf_counter() - t0, f"; removed steps {dropped}" if dropped else "")

    def _finish_staging(self, *_: Any) -> None:
        """Before an optimizer step changes the parameters in place: the async snapshot must be complete."""
        staging, self._staging = self._staging, None
        if staging is not None:
            t0 = time.perf_counter()
            try:
                staging.result()
            except Exception:  # the upload fails with it; wait() reports that
                pass
            self.last_staging_wait_s = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until an async save in flight is written and published; raise if it failed (collective)."""
        future, step = self._pending, self._pending_step
        if future is None:
            return
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
        self._raise_if_any_failed(step, error)

    def _raise_if_any_failed(self, step: int, error: BaseException | None) -> None:
        """Share every rank's outcome of a save, so that all raise together rather than some hanging."""
        mine = None if error is None else f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        outcomes: list[Any] = [mine]
        if self._pg is not None:
            outcomes = [None] * self.world_size
            dist.all_gather_object(outcomes, mine, group=self._pg)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not failed:
            return
        self._discard(step)
        rank, reason = failed[0]
        raise CheckpointError(
            f"checkpoint of step {step} failed on rank {rank} ({reason}); check free space and write permission in "
            f"{self.root}; {storage.latest_checkpoint_note(self.root)}"
        ) from error

    def _discard(self, step: int | None) -> None:
        if self.rank == 0 and step is not None:
            import shutil

            shutil.rmtree(storage.tmp_path(self.root, step), ignore_errors=True)
        if self._last_saved_step == step:
            self._last_saved_step = None

    def close(self) -> None:
        """Finish an async save in flight (call before the process group goes away) and free its host buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
                self._staged_sources = []

    def _async_stager(self):
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # The snapshot is copied in a background thread while the next forward/backward run (they only read the
            # parameters); the next optimizer step waits for it (_finish_staging). Pinned host memory and a side
            # stream speed up the device-to-host copy where CUDA provides them.
            cuda = self.device_type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
        return self._stager

    # ---------------------------------------------------------------- state

    def _state_dict(self, for_load: bool, sections: tuple[str, ...] | None = None) -> dict[str, Any]:
        model: dict[str, Any] = {}
        for part in self.model_parts:
            model.update(get_model_state_dict(part))
        state: dict[str, Any] = {"model": model}
        if sections is not None and "optimizer" not in sections:
            return state
        optim: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
        state["optimizer"] = optim
        if sections is not None:
            return state
        if self.lr_scheduler is not None:
            sched = self.lr_scheduler.state_dict()
            # lambdas are not data; LambdaLR keeps None in their place and restores the rest.
            state["lr_scheduler"] = {k: v for k, v in sched.items() if k != "lr_lambdas"}
        state["train_state"] = {"step": int(self.train_state.step), "tokens_seen": int(self.train_state.tokens_seen)}
        for name, obj in self.extra.items():
            state[name] = obj.state_dict()
        if not for_load:
            # The async writer reads these plain values later: hand it copies, not the live objects.
            import copy

            state = {k: (v if k in ("model", "optimizer") else copy.deepcopy(v)) for k, v in state.items()}
        return state

    def _set_state(self, state: dict[str, Any]) -> None:
        model_sd = state["model"]
        for part in self.model_parts:
            own = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in own})
        if "optimizer" in state:
            for part, opt in zip(self.model_parts, self.optimizers):
                set_optimizer_state_dict(part, opt, state["optimizer"], options=_OPTIM_OPTIONS)
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            sched = dict(state["lr_scheduler"])
            if hasattr(self.lr_scheduler, "lr_lambdas"):
                sched.setdefault("lr_lambdas", [None] * len(self.lr_scheduler.lr_lambdas))
            self.lr_scheduler.load_state_dict(sched)
        for name, obj in self.extra.items():
            if name in state:
                obj.load_state_dict(state[name])

    def _info(self, step: int, state: dict[str, Any], sync: bool) -> dict[str, Any]:
        args = self.model_args
        return {
            "step": step,
            "tokens_seen": int(self.train_state.tokens_seen),
            "world_size": self.world_size,
            "layout": self.layout,
            "ranks": self._ranks,
            "model_args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None,
            "export_dtype": self.cfg.export_dtype,
            "tokenizer": _tokenizer_path(self.job.data.tokenizer),
            "async": not sync,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
        }

    def _gather_dp_coordinates(self) -> list[dict[str, int]]:
        mine = {"dp_rank": self.dp_rank, "dp_degree": self.dp_degree}
        if self._pg is None:
            return [mine]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._pg)
        return everyone


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


def _tokenizer_path(spec: str) -> str:
    """data.tokenizer as export finds it later: an absolute path for a file or directory, else the name ("byte")."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec

"""Resuming a run: which checkpoint to continue from, whether it fits the run, and restoring the run from it.

Rank 0 chooses the checkpoint (checkpoint.resume: auto, never, a step or a path) and every rank follows its choice;
`auto` skips a damaged checkpoint (files that are not the ones checkpoint.json recorded) for the newest intact one.
Before DCP reads anything, rank 0 checks the files, the model family and definition saved in checkpoint.json are
compared with the run's, and the checkpoint's entries with what the model and optimizer expect, so that a misfit
is one line naming the cause rather than a DCP stack trace.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    checkpoint_entries,
    expected_entries,
    read_metadata,
)
from titan_npu.checkpoint.fit import describe_mismatch
from titan_npu.checkpoint.group import CheckpointGroup
from titan_npu.checkpoint.initial_load import full_model_shapes
from titan_npu.checkpoint.rank_state import pick_source_rank, read_rank_state, restore_rng
from titan_npu.checkpoint.state import RunState
from titan_npu.config.loader import config_to_dict, read_config_file
from titan_npu.config.schema import CheckpointConfig, JobConfig
from titan_npu.errors import CheckpointError
from titan_npu.lora.names import is_adapter_name

log = logging.getLogger("titan_npu")

# Config sections whose change makes a resumed run differ from an uninterrupted one (the layout may change freely).
_RESUME_SENSITIVE = ("model", "training", "optimizer", "lr_scheduler", "data")
_RESUME_NEUTRAL = ("num_workers",)


def choose_resume_target(cfg: CheckpointConfig) -> tuple[str | None, int | None]:
    """Rank 0's decision: the checkpoint to resume from (None: start fresh); raises on a conflict.

    Also returns, with checkpoint.overwrite, the step above which the previous run's checkpoints are replaced by
    this run's (None: nothing is replaced).
    """
    root = Path(cfg.dir)
    resume = str(cfg.resume).strip()
    existing = storage.list_checkpoints(root)
    storage.clean_unfinished(root)
    if resume == "never":
        if existing and not cfg.overwrite:
            raise CheckpointError(
                f"checkpoint.dir={root} already holds checkpoints (latest step {existing[-1].step}) and "
                "checkpoint.resume=never; set checkpoint.resume=auto to continue that run, "
                "checkpoint.overwrite=true to replace it, or choose another checkpoint.dir"
            )
        return None, -1 if existing else None
    if resume == "auto":
        return _latest_intact(root, existing), None
    ref = storage.resolve_checkpoint(resume, root)  # its files are checked when it is loaded (load_checkpoint)
    later = [c.step for c in existing if c.step > ref.step]
    if later and not cfg.overwrite:
        raise CheckpointError(
            f"checkpoint.resume={resume} picks step {ref.step} but {root} holds later checkpoints "
            f"(steps {', '.join(map(str, later))}) that this run would overwrite; set "
            "checkpoint.overwrite=true to replace them, or checkpoint.dir to a new directory"
        )
    return str(ref.path), ref.step if later else None


def _latest_intact(root: Path, existing: list[storage.CheckpointRef]) -> str | None:
    """The newest checkpoint whose files are the ones it saved; each damaged one skipped is named in a warning."""
    skipped: list[tuple[int, str]] = []
    for ref in reversed(existing):
        problem = storage.recorded_problem(ref.path)
        if problem is None:
            for step, why in skipped:
                log.warning("checkpoint: skipping damaged step %d: %s", step, why)
            if skipped:
                log.warning("checkpoint: resuming from step %d, the newest intact checkpoint in %s", ref.step, root)
            return str(ref.path)
        skipped.append((ref.step, problem))
    if skipped:
        raise CheckpointError(
            f"every checkpoint in {root} is damaged ({'; '.join(f'step {s}: {why}' for s, why in skipped)}); "
            "restore their files, or start over in another checkpoint.dir"
        )
    return None


def load_checkpoint(path: str | Path, job: JobConfig, run: RunState, group: CheckpointGroup, *, model_args: Any,
                    layout: str, sections: tuple[str, ...] | None = None, verified: bool = False) -> None:
    """Restore the run from one checkpoint directory (collective).

    sections=None restores everything, train_state.step and tokens_seen included (resume); ("model",) or
    ("model", "optimizer") start a new run from it. verified: rank 0 has already checked the files' integrity.
    """
    path = Path(path)
    storage.check_checkpoint_dir(path)
    # One rank checks the files against the index (and, unless done already, their digests); all refuse together.
    group.agree(lambda: _verify(path, digests=not verified), path)
    info = storage.read_info(path)
    check_model_family(path, info, model_args, resume=sections is None)
    t0 = time.perf_counter()
    state = run.state_dict(for_load=True, sections=sections)
    _check_fits(path, state, run, model_args, job.optimizer.name, group.rank, definition_diffs(info, model_args))
    if sections is None and not job.checkpoint.allow_model_change:
        check_model_definition(path, info, model_args)
    if sections is None or "optimizer" in sections:
        check_optimizer_state_dtype(path, info, job, group.rank)
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
             process_group=group.pg, no_dist=not group.distributed)
    run.set_state(state)
    if sections is None:
        _restore_rank_state(path, info, run, group.rank)
        run.train_state.step = int(state["train_state"]["step"])
        run.train_state.tokens_seen = int(state["train_state"]["tokens_seen"])
    if group.rank == 0:
        if sections is None:
            _warn_config_changes(job, path)
        what = f"step {info['step']}" if sections is None else f"{' and '.join(sections)} of step {info['step']}"
        saved_layout = info.get("layout") or ""
        changed = f" (saved under {saved_layout})" if saved_layout and saved_layout != layout else ""
        log.info("checkpoint: loaded %s from %s in %.1fs%s", what, path, time.perf_counter() - t0, changed)


def _verify(path: Path, digests: bool) -> None:
    """Raise the one-line refusal of a checkpoint whose files are not the ones it saved (rank 0)."""
    read_metadata(path, verify=True, digests=digests)


# Fields of a family's args that do not change the function the weights compute: the kernel choice, the preset's
# label, and the longest sequence the run allows (raised when a run continues on longer sequences).
_DEFINITION_NEUTRAL = ("use_flash_attention", "flavor", "max_seq_len")


def _plain(value: Any) -> Any:
    """A value as checkpoint.json holds it (tuples as lists), for comparing saved and current model args."""
    return json.loads(json.dumps(value, default=str))


def definition_diffs(info: dict[str, Any], model_args: Any) -> list[str]:
    """'field saved vs now' for each field of the family's args that differs from the checkpoint's model_args."""
    saved = info.get("model_args")
    if not isinstance(saved, dict) or not dataclasses.is_dataclass(model_args):
        return []  # a checkpoint from before model_args were recorded: the shapes are all there is to check
    now = _plain(dataclasses.asdict(model_args))
    return [f"{key} {_show(saved[key])} vs {_show(value)}" for key, value in now.items()
            if key in saved and key not in _DEFINITION_NEUTRAL and _plain(saved[key]) != value]


def check_model_family(path: Path, info: dict[str, Any], model_args: Any, resume: bool = True) -> None:
    """Refuse a checkpoint of another model family than the run's, saying both families."""
    saved = info.get("model_args")
    family = getattr(model_args, "family", None)
    if isinstance(saved, dict) and saved.get("family") not in (None, family) and family is not None:
        other = "give this run another checkpoint.dir" if resume else \
            f"point checkpoint.initial_load at {family} weights"
        raise CheckpointError(
            f"checkpoint {path.name} in {path.parent} is a {saved['family']} model, this run is {family}: set "
            f"model.name = \"{saved['family']}\" (and its [model] settings) to {'continue' if resume else 'use'} "
            f"it, or {other}"
        )


def check_model_definition(path: Path, info: dict[str, Any], model_args: Any) -> None:
    """Refuse to resume a checkpoint saved from another model definition than the run's [model] (same shapes, other
    function: heads, rope, norm, MoE routing ...), listing the fields; checkpoint.allow_model_change accepts it."""
    diffs = definition_diffs(info, model_args)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path.name} in {path.parent} was saved from another {getattr(model_args, 'family', '')} "
            f"model definition than [model] ({', '.join(diffs)}; checkpoint vs this run): set [model] as saved to "
            "resume it, or --checkpoint.allow_model_change true to resume with the new definition; nothing was "
            "changed on disk"
        )


def check_optimizer_state_dtype(path: Path, info: dict[str, Any], job: JobConfig, rank: int) -> None:
    """Refuse optimizer moments saved in another optimizer.state_dtype than the run's, unless
    checkpoint.convert_optimizer_state converts them (DCP reads them into the run's moments, casting; a checkpoint
    from before the dtype was recorded holds fp32 moments)."""
    saved, now = info.get("optimizer_state_dtype", "fp32"), job.optimizer.state_dtype
    if saved == now:
        return
    if not job.checkpoint.convert_optimizer_state:
        raise CheckpointError(
            f"checkpoint {path.name} in {path.parent} holds optimizer moments in {saved}, this run keeps them in "
            f"{now} (optimizer.state_dtype): set optimizer.state_dtype = '{saved}' to resume it as saved, or "
            "--checkpoint.convert_optimizer_state true to convert them; nothing was changed on disk"
        )
    if rank == 0:
        log.warning("checkpoint: optimizer moments converted from %s to %s (checkpoint.convert_optimizer_state)%s",
                    saved, now, "; bf16 rounds them to nearest" if now == "bf16" else "")


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _warn_config_changes(job: JobConfig, path: Path) -> None:
    """A resumed run follows its new config; say which settings that change the run differ from the saved."""
    try:
        saved = read_config_file(path / storage.CONFIG_FILE)
    except Exception:  # an unreadable or absent copy only loses this warning
        return
    now = config_to_dict(job)
    changed = [f"{section}.{key}: {saved[section].get(key)!r} -> {value!r}"
               for section in _RESUME_SENSITIVE if isinstance(saved.get(section), dict)
               for key, value in now.get(section, {}).items()
               if key in saved[section] and saved[section][key] != value and key not in _RESUME_NEUTRAL]
    if changed:
        log.warning("checkpoint: resuming with a changed config (the run is no longer an exact continuation): %s",
                    "; ".join(changed))


def _check_fits(path: Path, state: dict[str, Any], run: RunState, model_args: Any, optimizer_name: str,
                rank: int, diffs: list[str] | None = None) -> None:
    """Compare what the run expects with what the checkpoint holds, before DCP reads anything.

    Extra states the checkpoint lacks are dropped from `state` (they keep their fresh values).
    """
    found = checkpoint_entries(read_metadata(path, verify=False))  # rank 0 verified the files (load_checkpoint)
    expected = expected_entries(state)

    def section(prefix: str, table: dict) -> dict[str, tuple]:
        return {k[len(prefix):]: (v[1] if v[0] == "tensor" else ()) for k, v in table.items()
                if k.startswith(prefix)}

    # The whole model, not this rank's pipeline stage: a checkpoint holds every stage.
    model_expected = _full_model_shapes(model_args) or section("model.", expected)
    adapters = {k: v for k, v in section("model.", expected).items() if is_adapter_name(k)}
    if adapters:  # LoRA: this stage's adapters as the run has them, other stages' as the checkpoint holds them
        others = {k: v for k, v in section("model.", found).items() if is_adapter_name(k)}
        model_expected = {**model_expected, **others, **adapters}
    problem = describe_mismatch(model_expected, section("model.", found))
    saved_adapters = {k: v for k, v in section("model.", found).items() if is_adapter_name(k)}
    if problem and saved_adapters != adapters:
        saved = storage.read_info(path).get("lora") or {}
        trained = f"rank {saved['rank']} on {saved['target_modules']}" if saved else "without [lora]"
        raise CheckpointError(f"checkpoint {path} was trained {trained}, which [lora] here does not match "
                              f"({problem.split(' -- ')[0]}); resume with the [lora] it was trained with, or export "
                              f"its merged weights (titan-npu export --format hf --merge) and start a new run from "
                              f"them (checkpoint.initial_load, another checkpoint.dir)")
    if problem:
        differs = f" ([model] vs the checkpoint's: {', '.join(diffs)}, checkpoint vs this run)" if diffs else ""
        raise CheckpointError(f"checkpoint {path} does not fit the model: {problem}{differs}")
    if "optimizer" in state:
        exp_opt = {k: v for k, v in section("optimizer.", expected).items() if k.startswith("state.")}
        got_opt = {k: v for k, v in section("optimizer.", found).items() if k.startswith("state.")}
        # Entries of other stages' parameters are not this rank's concern.
        stage_params = {k.rsplit(".", 1)[0] for k in exp_opt}
        got_opt = {k: v for k, v in got_opt.items() if k.rsplit(".", 1)[0] in stage_params}
        problem = describe_mismatch(exp_opt, got_opt)
        if problem:
            raise CheckpointError(
                f"optimizer state in {path} does not fit this optimizer ({optimizer_name}): "
                f"{problem.split(' -- ')[0]} -- likely optimizer.name changed since the save; keep it, or start "
                f"from the weights alone with checkpoint.initial_load={path} and checkpoint.resume=never"
            )
    for key in ("lr_scheduler", "train_state"):
        if key in state and not any(k.startswith(f"{key}.") for k in found):
            raise CheckpointError(f"checkpoint {path} has no '{key}' state; it was not written by the trainer, "
                                  f"start from its weights with checkpoint.initial_load={path}")
    for key in run.extra:
        # State added to the trainer after the checkpoint was written starts fresh instead of refusing it.
        if key in state and not any(k.startswith(f"{key}.") for k in found):
            state.pop(key)
            if rank == 0:
                log.warning("checkpoint: %s holds no '%s' state; it starts fresh", path, key)


def _full_model_shapes(model_args: Any) -> dict[str, tuple[int, ...]] | None:
    if model_args is None:
        return None
    return {k: tuple(v) for k, v in full_model_shapes(model_args).items()}


def _restore_rank_state(path: Path, info: dict[str, Any], run: RunState, rank: int) -> None:
    saved = info.get("ranks") or [{"dp_rank": 0, "dp_degree": 1}]
    source = pick_source_rank(saved, rank, run.dp_rank, run.dp_degree)
    state = read_rank_state(path, source)
    if run.dataloader is not None and state.get("dataloader") is not None:
        reshard = saved[source]["dp_degree"] != run.dp_degree
        # Fault tolerance re-splits the data among the replica groups each step: the saved split is not the layout's.
        resplit = state["dataloader"].get("dp_world_size") != getattr(run.dataloader, "dp_world_size", None)
        if reshard and rank == 0:
            log.warning("checkpoint: data-parallel size changed %d -> %d; the data continues at the same global "
                        "position with the new split", saved[source]["dp_degree"], run.dp_degree)
        if reshard or resplit:
            run.dataloader.load_state_dict(state["dataloader"], allow_reshard=True)
        else:
            run.dataloader.load_state_dict(state["dataloader"])
    if state.get("rng") is not None:
        restore_rng(state["rng"], run.device_type)

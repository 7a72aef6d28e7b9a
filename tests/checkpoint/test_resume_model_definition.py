"""Resume checks the whole model definition that checkpoint.json recorded, not only the tensor shapes: another family
is refused naming both families; any other differing field of the family's args (heads, rope, norm, MoE routing)
is refused in one line listing them and the flag that accepts it (checkpoint.allow_model_change); nothing changes
on disk."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
from tiny_run import snapshot, tiny_args, train_tiny

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.resume import definition_diffs
from titan_npu.cli import main as cli_main
from titan_npu.config.schema import ModelConfig
from titan_npu.models.registry import build_model_args


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real tiny llama3 run of two steps: its run folder (ckpt/step-1, ckpt/step-2, logs)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train_tiny(run, steps=2, checkpoint__save_interval=1)
    return run


def _resume(trained: Path, tmp_path: Path, capsys, *extra: str) -> tuple[int, str, str, Path, dict]:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = snapshot(run)
    capsys.readouterr()
    rc = cli_main(["train", *tiny_args(run, training__max_steps=3, checkpoint__async_save=False), *extra])
    out, err = capsys.readouterr()
    return rc, out, err, run, before


def _refused(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("CheckpointError: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("extra, listed", [
    (["--model.rope_theta", "10000"], ["rope_theta 500000.0 vs 10000.0"]),
    (["--model.norm_eps", "1e-6"], ["norm_eps 1e-05 vs 1e-06"]),
    (["--model.norm_eps", "1e-6", "--model.rope_theta", "10000"], ["norm_eps 1e-05 vs 1e-06",
                                                                    "rope_theta 500000.0 vs 10000.0"]),
    (["--model.rope_scaling_factor", "8"], ["rope_scaling_factor None vs 8.0"]),
])
def test_resume_with_another_model_definition_of_the_same_shapes_is_refused_listing_the_fields(
        trained, tmp_path, capsys, extra, listed):
    rc, out, err, run, before = _resume(trained, tmp_path, capsys, *extra)
    line = _refused(rc, err)
    assert re.search(r"checkpoint step-2 in \S+ was saved from another llama3 model definition than \[model\]", line)
    for field in listed:
        assert field in line, line
    assert "checkpoint vs this run" in line and "--checkpoint.allow_model_change true" in line
    assert snapshot(run) == before, "a refused resume changed the run folder"


def test_the_flag_accepts_a_changed_model_definition(trained, tmp_path, capsys):
    rc, out, err, run, _ = _resume(trained, tmp_path, capsys, "--model.rope_theta", "10000",
                                   "--checkpoint.allow_model_change", "true")
    assert rc == 0, err
    assert re.search(r"checkpoint: loaded step 2 from", out + err)
    assert [ref.step for ref in storage.list_checkpoints(run / "ckpt")] == [1, 2, 3]


def test_resume_as_another_family_names_both_families(trained, tmp_path, capsys):
    rc, out, err, run, before = _resume(trained, tmp_path, capsys, "--model.name", "qwen3")
    line = _refused(rc, err)
    assert "checkpoint step-2 in" in line and "is a llama3 model, this run is qwen3" in line, line
    assert 'set model.name = "llama3"' in line and "another size" not in line
    assert snapshot(run) == before


def test_resume_with_other_shapes_names_the_fields_that_differ(trained, tmp_path, capsys):
    rc, out, err, run, before = _resume(trained, tmp_path, capsys, "--model.dim", "128")
    line = _refused(rc, err)
    assert "does not fit the model" in line and "shape mismatch" in line
    assert "[model] vs the checkpoint's: dim 64 vs 128" in line, line
    assert snapshot(run) == before


def test_the_fields_that_only_choose_a_kernel_or_a_longer_context_may_change(trained, tmp_path, capsys):
    rc, out, err, *_ = _resume(trained, tmp_path, capsys, "--model.max_seq_len", "128", "--model.use_flash_attention",
                               "false")
    assert rc == 0, err


def test_moe_routing_arguments_are_part_of_the_definition():
    args = build_model_args(ModelConfig(name="qwen3_moe"))
    info = {"model_args": dataclasses.asdict(args)}
    other = dataclasses.replace(args, top_k=args.top_k + 1, capacity_factor=2.0)
    diffs = definition_diffs(info, other)
    assert f"top_k {args.top_k} vs {args.top_k + 1}" in diffs and any(d.startswith("capacity_factor") for d in diffs)
    assert definition_diffs(info, args) == []


def test_a_checkpoint_without_recorded_model_args_is_checked_by_shapes_only():
    args = build_model_args(ModelConfig(name="llama3"))
    assert definition_diffs({"model_args": None}, args) == [] and definition_diffs({}, args) == []


def test_initial_load_of_a_step_of_another_family_names_both_families(trained, tmp_path, capsys):
    capsys.readouterr()
    rc = cli_main(["train", *tiny_args(tmp_path / "new", training__max_steps=1), "--model.name", "qwen3",
                   "--checkpoint.initial_load", str(trained / "ckpt" / "step-2")])
    line = _refused(rc, capsys.readouterr().err)
    assert "is a llama3 model, this run is qwen3" in line and "point checkpoint.initial_load at qwen3 weights" in line
    assert not (tmp_path / "new").exists()

"""Checkpoints record optimizer.state_dtype (checkpoint.json, and the moments' own dtype in DCP): a bf16-moment run
resumed from its step-k checkpoint continues with the uninterrupted run's losses bit for bit; resuming with another
state dtype is refused in one line naming both and the flag, nothing changed on disk; with
checkpoint.convert_optimizer_state the moments are converted (bf16: the saved fp32 rounded to nearest)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_run import snapshot, tiny_args

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata
from titan_npu.cli import main as cli_main

from .runs import copy_checkpoint, losses, overrides, run_here

BF16 = dict(optimizer__state_dtype="bf16")


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
def test_a_run_with_bf16_moments_resumes_exactly(tmp_path, optimizer):
    extra = dict(BF16, optimizer__name=optimizer, checkpoint__save_interval=2)
    run_here(overrides(tmp_path, "full", training__max_steps=4, **extra))
    copy_checkpoint(tmp_path, "full", 2, "resumed")
    run_here(overrides(tmp_path, "resumed", training__max_steps=4, **extra))
    full, resumed = losses(tmp_path, "full"), losses(tmp_path, "resumed")
    assert sorted(resumed) == [3, 4] and [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]
    step2 = tmp_path / "full" / "ckpt" / "step-2"
    assert json.loads((step2 / storage.INFO_FILE).read_text())["optimizer_state_dtype"] == "bf16"
    entries = read_metadata(step2).state_dict_metadata
    moments = [k for k in entries if k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert moments and all(entries[k].properties.dtype == torch.bfloat16 for k in moments)
    # The resumed run's own last checkpoint equals the uninterrupted one's, tensor for tensor.
    ours, theirs = (tmp_path / name / "ckpt" / "step-4" for name in ("resumed", "full"))
    keys = [k for k, v in read_metadata(theirs).state_dict_metadata.items() if hasattr(v, "size")]
    a, b = load_tensors(ours, read_metadata(ours), keys), load_tensors(theirs, read_metadata(theirs), keys)
    assert [k for k in keys if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """A tiny run of two steps with fp32 moments (the default), checkpointed at step 2."""
    run = tmp_path_factory.mktemp("fp32") / "run"
    assert cli_main(["train", *tiny_args(run, training__max_steps=2, checkpoint__async_save=False)]) == 0
    return run


def test_resuming_with_another_state_dtype_is_refused_in_one_line(fp32_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(fp32_run, run)
    before = snapshot(run)
    capsys.readouterr()
    rc = cli_main(["train", *tiny_args(run, training__max_steps=3, checkpoint__async_save=False, **BF16)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("CheckpointError: checkpoint step-2 in "), lines[0]
    for words in ("holds optimizer moments in fp32, this run keeps them in bf16", "optimizer.state_dtype = 'fp32'",
                  "--checkpoint.convert_optimizer_state true"):
        assert words in lines[0], lines[0]
    assert snapshot(run) == before


def test_convert_optimizer_state_resumes_with_the_moments_rounded_to_bf16(fp32_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fp32_run, run)
    step2 = run / "ckpt" / "step-2"
    metadata = read_metadata(step2)
    saved = load_tensors(step2, metadata, [k for k in metadata.state_dict_metadata if k.endswith("exp_avg_sq")])
    trainer = run_here(tiny_args(run, training__max_steps=3, checkpoint__async_save=False,
                                 checkpoint__convert_optimizer_state=True, **BF16), train=False)
    assert trainer.step == 2
    checked = 0
    for name, param in trainer.model.named_parameters():
        moment = trainer.optimizer.state[param]["exp_avg_sq"]
        assert moment.dtype == torch.bfloat16
        assert torch.equal(moment, saved[f"optimizer.state.{name}.exp_avg_sq"].to(torch.bfloat16)), name
        checked += 1
    assert checked == len(saved)

"""Which checkpoint a run resumes from, per checkpoint.resume and checkpoint.overwrite, and what it refuses."""

from __future__ import annotations

import pytest

from titan_npu.checkpoint.resume import choose_resume_target
from titan_npu.errors import CheckpointError

from .conftest import fake_checkpoint, job_config


def _cfg(tmp_path, steps, **checkpoint):
    cfg = job_config(tmp_path, **checkpoint).checkpoint
    for step in steps:
        fake_checkpoint(tmp_path / "ckpt", step)
    return cfg


@pytest.mark.parametrize("steps, resume, overwrite, target, stale_above", [
    ((), "auto", False, None, None),
    ((2, 4), "auto", False, "step-4", None),
    ((), "never", False, None, None),
    ((2, 4), "never", True, None, -1),  # a new run: every checkpoint of the old one is replaced
    ((2, 4), "4", False, "step-4", None),
    ((2, 4), "2", True, "step-2", 2),  # this run's checkpoints replace step 4 of the old one
])
def test_the_resume_target_and_the_checkpoints_this_run_replaces(tmp_path, steps, resume, overwrite, target,
                                                                 stale_above):
    cfg = _cfg(tmp_path, steps, resume=resume, overwrite=overwrite)
    path, stale = choose_resume_target(cfg)
    assert (path, stale) == (target and str(tmp_path / "ckpt" / target), stale_above)


def test_an_interrupted_save_is_cleared_and_never_chosen(tmp_path):
    cfg = _cfg(tmp_path, (2,), resume="auto")
    (tmp_path / "ckpt" / "step-3.tmp").mkdir()
    assert choose_resume_target(cfg) == (str(tmp_path / "ckpt" / "step-2"), None)
    assert not (tmp_path / "ckpt" / "step-3.tmp").exists()


@pytest.mark.parametrize("resume, message", [
    ("never", r"already holds checkpoints \(latest step 4\) and checkpoint.resume=never; set checkpoint.resume=auto"),
    ("2", r"picks step 2 but .* holds later checkpoints \(steps 4\) that this run would overwrite; set "
          r"checkpoint.overwrite=true"),
])
def test_a_run_that_would_overwrite_checkpoints_is_refused_unless_told(tmp_path, resume, message):
    with pytest.raises(CheckpointError, match=message):
        choose_resume_target(_cfg(tmp_path, (2, 4), resume=resume))

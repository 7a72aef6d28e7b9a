"""Every parallel layout trains exactly like one process: from the same training.seed (no seed checkpoint: the
initial weights must not depend on the layout) and the same global batch, the gathered initial weights are equal
bit for bit and the per-step losses equal to 1e-5 relative (gradient norms to 1e-4) over 10 fp32 steps (gloo,
deterministic mode). For Llama 3, Qwen3 (every layout) and Qwen2 (FSDP, TP, FSDP x TP): conftest.py's CASES."""

from __future__ import annotations

import pytest
import torch

from .conftest import CASES, SEED_CHECKPOINTS, SLOW_CASES
from .harness import STEPS, initial_weights, losses, losses_by_step, marked_slow, reference_name

pytestmark = pytest.mark.distributed

RTOL = 1e-5
# The gradient norm (global over shards, tensor-parallel slices and pipeline stages) of small late-step gradients
# carries the reduction-order noise of the layout a little further.
GRAD_NORM_RTOL = 1e-4


@pytest.mark.parametrize("name", marked_slow(CASES, SLOW_CASES))
def test_layout_losses_match_single_process(layout_runs, name):
    case = CASES[name]
    got, want = losses(layout_runs, name), losses(layout_runs, case.reference_run)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {case.reference_run}:\n{got}\n{want}"
    norms, want_norms = losses(layout_runs, name, "grad_norm"), losses(layout_runs, case.reference_run, "grad_norm")
    assert norms == pytest.approx(want_norms, rel=GRAD_NORM_RTOL), f"{name} grad_norm:\n{norms}\n{want_norms}"


@pytest.mark.parametrize("name", marked_slow(CASES, SLOW_CASES))
def test_layout_starts_from_the_single_process_weights(layout_runs, name):
    (want,) = initial_weights(layout_runs, CASES[name].reference_run)
    per_rank = initial_weights(layout_runs, name)
    assert per_rank, f"{name}: no initial weights saved"
    seen = set()
    for rank, got in enumerate(per_rank):
        for key, value in got.items():
            assert torch.equal(value, want[key]), f"{name} rank {rank}: {key} differs from one process's"
        seen |= set(got)
    assert seen == set(want), f"{name}: the ranks together hold {sorted(set(want) - seen)} nowhere"


@pytest.mark.parametrize("model", SEED_CHECKPOINTS)
def test_a_seed_checkpoint_starts_another_layout_from_the_same_weights(layout_runs, model):
    # Written by `titan-npu init-weights` in one process, loaded by tensor parallel 2 through initial_load.
    reference, run = reference_name(model, "ref_b4"), reference_name(model, "tp_from_seed_checkpoint")
    (want,) = initial_weights(layout_runs, reference)
    for rank, got in enumerate(initial_weights(layout_runs, run)):
        assert set(got) == set(want)
        for key, value in got.items():
            assert torch.equal(value, want[key]), f"rank {rank}: {key}"
    assert losses(layout_runs, run) == pytest.approx(losses(layout_runs, reference), rel=RTOL)


def test_references_differ_by_batch(parallel_workspace):
    # Guards the comparison itself: different global batches give different losses, so equality above means
    # the layout saw the same data and computed the same update.
    b4, b8 = losses(parallel_workspace, "ref_b4"), losses(parallel_workspace, "ref_b8")
    assert b4[0] != pytest.approx(b8[0], rel=RTOL)


def test_pipeline_run_resumes_exactly_from_its_checkpoint(layout_runs):
    # Interleaved schedule: two stages and two optimizers per rank, saved at step 5 and restored.
    straight = losses_by_step(layout_runs, "pp_straight")
    first, resumed = losses_by_step(layout_runs, "pp_first_half"), losses_by_step(layout_runs, "pp_resumed")
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [6, 7, 8, 9, 10]
    assert {**first, **resumed} == pytest.approx(straight, rel=1e-6)

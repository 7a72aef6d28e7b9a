"""Muon trains alike in every layout: under FSDP 2 (each matrix gathered whole before Newton-Schulz), TP 2 (the
full matrix orthogonalised, not each shard), PP 2 (an optimizer per stage) and EP 2 (stacked experts orthogonalised
one by one, never gathered over the experts) the per-step losses equal one process's to 1e-5 relative over 10 fp32
steps; a run resumed from its step-5 DCP checkpoint (momentum buffers sharded like their parameters) continues
bit for bit. All runs in one 2-rank pool."""

from __future__ import annotations

import pytest

from .harness import STEPS, losses, losses_by_step, run_here, run_pool, tiny_run

pytestmark = pytest.mark.distributed

RTOL = 1e-5
# Newton-Schulz in fp32 (bf16's rounding would hide what the layouts must agree on); a constant lr after warmup, so
# that a run cut at step 5 and resumed follows the FSDP layout's schedule and muon_fsdp is the uninterrupted run.
MUON = ["--optimizer.name=Muon", "--optimizer.muon_ns_dtype=fp32", "--lr_scheduler.decay_type=constant"]
# A tiny Qwen3-MoE: 4 experts of 2 per token in every layer, without the load-balancing loss (each layout pools it
# over its own micro-batches).
MOE = ["--model.name=qwen3_moe", "--model.flavor=debug", "--model.n_experts=4", "--model.top_k=2",
       "--model.moe_ffn_dim=32", "--model.head_dim=16", "--model.router_aux_loss_coef=0"]

# name -> (overrides on the tiny run, the one-process reference it must match). Two ranks split a batch of 8.
CASES = {
    "muon_fsdp": ([], "muon_ref_b8"),
    "muon_tp": (["--parallel.tp_degree=2"], "muon_ref_b4"),
    "muon_pp": (["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"], "muon_ref_b4"),
    "muon_ep": ([*MOE, "--parallel.ep_degree=2"], "muon_moe_ref_b8"),
}
REFERENCES = {"muon_ref_b4": (4, []), "muon_ref_b8": (8, []), "muon_moe_ref_b8": (8, MOE)}


@pytest.fixture(scope="module")
def muon_runs(parallel_workspace):
    """The one-process references here, then every layout and the resume runs (after muon_fsdp, the run they cut
    at step 5 and resume) in one 2-rank pool."""
    workdir = parallel_workspace
    run_here([tiny_run(workdir, name, batch) + MUON + extra for name, (batch, extra) in REFERENCES.items()])
    ckpt = [f"--checkpoint.dir={workdir / 'muon_ckpt'}", "--checkpoint.enable=true", "--checkpoint.async_save=false"]
    layouts = [tiny_run(workdir, name) + MUON + extra for name, (extra, _) in CASES.items()]
    resume = [
        tiny_run(workdir, "muon_first_half") + MUON + ckpt + ["--training.max_steps=5", "--checkpoint.save_interval=5"],
        tiny_run(workdir, "muon_resumed") + MUON + ckpt,
    ]
    run_pool(2, layouts + resume)
    return workdir


@pytest.mark.parametrize("name", list(CASES))
def test_muon_layout_losses_match_single_process(muon_runs, name):
    reference = CASES[name][1]
    got, want = losses(muon_runs, name), losses(muon_runs, reference)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {reference}:\n{got}\n{want}"


def test_muon_references_differ_from_adamw(muon_runs):
    # Guards the comparison: the Muon runs did take Muon's steps. conftest's ref_b8 is AdamW from the same weights
    # and batches; both schedules are still in the same warmup at the first update, so step 2 differs by it alone.
    muon, adamw = losses(muon_runs, "muon_ref_b8"), losses(muon_runs, "ref_b8")
    assert muon[0] == adamw[0]
    assert muon[1] != pytest.approx(adamw[1], rel=1e-4)


def test_muon_fsdp_run_resumes_bit_for_bit_from_its_checkpoint(muon_runs):
    straight = losses_by_step(muon_runs, "muon_fsdp")
    first, resumed = losses_by_step(muon_runs, "muon_first_half"), losses_by_step(muon_runs, "muon_resumed")
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [6, 7, 8, 9, 10]
    assert {**first, **resumed} == straight

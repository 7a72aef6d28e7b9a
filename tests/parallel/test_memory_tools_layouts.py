"""Activation offload and bf16 optimizer moments on 2 gloo ranks: under FSDP 2, TP 2, a 2-stage 1F1B pipeline and
a MoE model's expert parallelism 2, offload gives the per-step losses of the same layout without it bit for bit (the
hooks run inside FSDP's, tensor parallelism's, the pipeline schedule's and the experts' all-to-alls' forward and
backward; sequence-parallel DTensors stay on the device; 1F1B holds two micro-batches' saved tensors at once);
bf16 moments, FSDP-sharded like their parameters, follow one process with bf16 moments over 10 fp32 steps to 1e-4
relative. All runs in one 2-rank pool."""

from __future__ import annotations

import pytest

from .harness import STEPS, losses, run_here, run_pool, tiny_run

pytestmark = pytest.mark.distributed

# Every saved tensor of the kept blocks moves (selective checkpointing, with every second block recomputed: the
# one-process tests of test_activation_offload.py).
OFFLOAD = ["--activation_checkpoint.offload=true", "--activation_checkpoint.offload_min_bytes=0"]
PP = ["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"]
BF16_STATE = ["--optimizer.state_dtype=bf16"]
RTOL_BF16_STATE = 1e-4  # FSDP's reduction order moves a few moments across a bf16 rounding boundary

# name -> overrides; "<name>_offload" runs each with OFFLOAD on top.
# A tiny Qwen3-MoE with its 4 experts split over the 2 ranks (the tokens' all-to-alls inside the offloaded blocks).
EP = ["--model.name=qwen3_moe", "--model.flavor=debug", "--model.n_experts=4", "--model.top_k=2",
      "--model.moe_ffn_dim=32", "--model.head_dim=16", "--parallel.ep_degree=2"]
LAYOUTS = {"mt_fsdp": [], "mt_tp": ["--parallel.tp_degree=2"], "mt_pp": PP, "mt_ep": EP}


@pytest.fixture(scope="module")
def runs(parallel_workspace):
    workdir = parallel_workspace
    run_here([tiny_run(workdir, "mt_bf16_state_ref_b8", 8) + BF16_STATE])
    jobs = [tiny_run(workdir, name) + extra for name, extra in LAYOUTS.items()]
    jobs += [tiny_run(workdir, f"{name}_offload") + extra + OFFLOAD for name, extra in LAYOUTS.items()]
    jobs.append(tiny_run(workdir, "mt_fsdp_bf16_state") + BF16_STATE)
    run_pool(2, jobs)
    return workdir


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_gives_the_same_layouts_losses_bit_for_bit(runs, name):
    plain, offloaded = losses(runs, name), losses(runs, f"{name}_offload")
    assert len(plain) == STEPS and offloaded == plain


def test_fsdp_with_bf16_moments_follows_one_process_with_bf16_moments(runs):
    got, want = losses(runs, "mt_fsdp_bf16_state"), losses(runs, "mt_bf16_state_ref_b8")
    assert len(want) == STEPS and got == pytest.approx(want, rel=RTOL_BF16_STATE)
    assert want != losses(runs, "ref_b8")  # the reference's moments were bf16 indeed

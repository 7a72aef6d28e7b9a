"""The V-shaped pipeline schedules (ZBVZeroBubble, DualPipeV: two stages per rank, rank r holding stages r and
2 pp - 1 - r, each backward split into an input step and a later weight step) train exactly like one process: the
per-step losses equal to 1e-5 relative, gradient norms to 1e-4 and the final weights to FINAL_ATOL over 10 fp32
steps (gloo, deterministic mode), for Llama 3 (also under full activation checkpointing, and with FSDP 2 across the
split weight backward) and for Qwen3-MoE with its load-balancing loss on (pooled per micro-batch, so its reference
accumulates one micro-batch per step)."""

from __future__ import annotations

import pytest

from .harness import (
    STEPS,
    final_weights,
    final_weights_run,
    initial_weights,
    losses,
    run_here,
    run_pool,
    tiny_run,
    write_tokens,
)

pytestmark = pytest.mark.distributed

RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# Ten AdamW steps at lr 3e-3: Adam's normalised update carries the reduction-order noise of near-zero gradients into
# the weights. 1F1B at pp 2 ends 1.2e-5 (Llama) and 3.2e-5 (Qwen3-MoE) from one process; the V schedules the same.
FINAL_ATOL = 1e-4

PP2 = ["--parallel.pp_degree=2"]
# A tiny Qwen3-MoE: 4 experts top-2 in each of 4 layers (one per stage of the V at pp 2), untied, aux loss 0.01.
QWEN3_MOE = ["--model.name=qwen3_moe", "--model.flavor=debug", "--model.dim=64", "--model.n_layers=4",
             "--model.n_heads=4", "--model.n_kv_heads=2", "--model.head_dim=16", "--model.ffn_dim=64",
             "--model.vocab_size=512", "--model.max_seq_len=64", "--model.n_experts=4", "--model.moe_ffn_dim=32",
             "--model.tie_embeddings=false", "--model.router_aux_loss_coef=0.01"]

# Single-process references: name -> (batch size, overrides). The MoE one runs the pipeline's 4 micro-batches of 1
# as 4 accumulation steps, so its load-balancing loss pools the same tokens per forward.
REFERENCES = {
    "ref_b4": (4, []),
    "ref_b8": (8, []),
    "moe_ref": (1, [*QWEN3_MOE, "--training.gradient_accumulation_steps=4"]),
}
# name -> (ranks, overrides, reference)
LAYOUTS = {
    "zbv_pp2": (2, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble"], "ref_b4"),
    "dualpipev_pp2_ac_full": (2, [*PP2, "--parallel.pp_schedule=DualPipeV", "--activation_checkpoint.mode=full"],
                              "ref_b4"),
    "moe_zbv_pp2": (2, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble", *QWEN3_MOE], "moe_ref"),
    "moe_dualpipev_pp2": (2, [*PP2, "--parallel.pp_schedule=DualPipeV", *QWEN3_MOE], "moe_ref"),
    "zbv_fsdp2_pp2": (4, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble"], "ref_b8"),
}


@pytest.fixture(scope="module")
def v_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("v_schedules")
    write_tokens(workdir / "tokens.jsonl")
    run_here([final_weights_run(tiny_run(workdir, name, batch) + extra)
              for name, (batch, extra) in REFERENCES.items()])
    for world in (2, 4):
        run_pool(world, [final_weights_run(tiny_run(workdir, name) + extra)
                         for name, (ranks, extra, _) in LAYOUTS.items() if ranks == world])
    return workdir


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_v_schedule_trains_like_one_process(v_runs, name):
    reference = LAYOUTS[name][2]
    got, want = losses(v_runs, name), losses(v_runs, reference)
    assert len(got) == STEPS and len(want) == STEPS
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {reference}:\n{got}\n{want}"
    norms, want_norms = losses(v_runs, name, "grad_norm"), losses(v_runs, reference, "grad_norm")
    assert norms == pytest.approx(want_norms, rel=GRAD_NORM_RTOL)
    weights, want_weights = final_weights(v_runs, name), final_weights(v_runs, reference)
    assert set(weights) == set(want_weights)
    worst = max((weights[k] - want_weights[k]).abs().max().item() for k in weights)
    assert worst <= FINAL_ATOL, f"{name}: final weights differ from one process's by up to {worst:.3g}"
    # Guards the comparison: training moved the weights far beyond the tolerance.
    (start,) = initial_weights(v_runs, reference)
    assert max((want_weights[k] - start[k]).abs().max().item() for k in start) > 100 * FINAL_ATOL
    if reference == "moe_ref":  # the load-balancing loss was on, and is reported like one process's
        assert losses(v_runs, name, "aux_loss") == pytest.approx(losses(v_runs, reference, "aux_loss"), rel=RTOL)

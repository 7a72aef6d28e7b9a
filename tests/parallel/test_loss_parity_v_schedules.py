"""The V-shaped pipeline schedules (ZBVZeroBubble, DualPipeV: two stages per rank, rank r holding stages r and
2 pp - 1 - r, each backward split into an input step and a later weight step) train exactly like one process: the
per-step losses equal to 1e-5 relative, gradient norms to 1e-4 and the final weights to FINAL_ATOL over 10 fp32
steps (gloo, deterministic mode), for Llama 3 (also under full activation checkpointing, with FSDP 2 across the
split weight backward, and on unequal stages: 6 layers in 4) and for Qwen3-MoE with its load-balancing loss on
(pooled per micro-batch, so its reference accumulates one micro-batch per step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import (
    BATCH,
    STEPS,
    final_weights,
    final_weights_run,
    initial_weights,
    losses,
    marked_slow,
    run_here,
    run_pool,
    selected_ids,
    tiny_run,
    write_tokens,
)

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]

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
    "ref_b4_6_layers": (4, ["--model.n_layers=6"]),
}
# name -> (ranks, overrides, reference)
LAYOUTS = {
    "zbv_pp2": (2, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble"], "ref_b4"),
    "dualpipev_pp2_ac_full": (2, [*PP2, "--parallel.pp_schedule=DualPipeV", "--activation_checkpoint.mode=full"],
                              "ref_b4"),
    "moe_zbv_pp2": (2, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble", *QWEN3_MOE], "moe_ref"),
    "moe_dualpipev_pp2": (2, [*PP2, "--parallel.pp_schedule=DualPipeV", *QWEN3_MOE], "moe_ref"),
    "zbv_fsdp2_pp2": (4, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble"], "ref_b8"),
    # 6 layers in the 4 stages: unequal (1, 2, 2, 1; rank 1 holds 4 layers, rank 0 the two ends and 2 layers).
    "zbv_pp2_6_layers": (2, [*PP2, "--parallel.pp_schedule=ZBVZeroBubble", "--model.n_layers=6"], "ref_b4_6_layers"),
}


# With -m slow: DualPipeV with tensor parallelism inside the stages (TP 2 x PP 2, 4 ranks), and DeepSeek-V3's debug
# model (its first block dense, grouped routing, aux-loss-free score biases updated after every step from the
# stages' expert loads) under DualPipeV against one process accumulating the same 4 micro-batches.
DEEPSEEK = ROOT / "configs" / "debug_deepseek.toml"
SLOW_LAYOUTS = {
    "dualpipev_tp2_pp2": (4, [*PP2, "--parallel.tp_degree=2", "--parallel.pp_schedule=DualPipeV"], "ref_b4"),
    "deepseek_dualpipev_pp2": (2, [*PP2, "--parallel.pp_schedule=DualPipeV", "--model.score_bias_rate=0.01"],
                               "deepseek_ref"),
}
# torch's InterleavedZeroBubble (looped placement, the same split backward and FSDP rule) under FSDP 2 x PP 2.
SLOW_LAYOUTS["izb_fsdp2_pp2"] = (4, [*PP2, "--parallel.pp_schedule=InterleavedZeroBubble"], "ref_b8")
SLOW_REFERENCES = {"deepseek_ref": (1, ["--model.score_bias_rate=0.01", "--training.gradient_accumulation_steps=4"])}
# Qwen3-MoE with its experts split over the 2 FSDP ranks of each stage (EP 2 x PP 2): the load-balancing loss pools
# each rank's own micro-batch, which no one process does, so DualPipeV is held to 1F1B on the same layout.
EP2 = [*PP2, "--parallel.ep_degree=2", *QWEN3_MOE]
SLOW_LAYOUTS["moe_ep2_1f1b_pp2"] = (4, EP2, None)
SLOW_LAYOUTS["moe_ep2_dualpipev_pp2"] = (4, [*EP2, "--parallel.pp_schedule=DualPipeV"], "moe_ep2_1f1b_pp2")


def _job(workdir, name: str, batch: int, extra: list[str]):
    """A run that leaves its final weights; DeepSeek's on its debug config (the tiny run's sizes, its own model)."""
    args = tiny_run(workdir, name, batch)
    if name.startswith("deepseek"):
        args = [a for a in args if not a.startswith("--model.")] + ["--model.dim=64", "--model.max_seq_len=64"]
        return final_weights_run(args + extra, DEEPSEEK)
    return final_weights_run(args + extra)


@pytest.fixture(scope="module")
def v_runs(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("v_schedules")
    write_tokens(workdir / "tokens.jsonl")
    selected = set(selected_ids(request, "test_v_schedule_trains_like_one_process"))
    selected |= {ALL_LAYOUTS[name][2] for name in selected}  # a reference that is itself a layout's run
    layouts = {name: case for name, case in ALL_LAYOUTS.items() if name in selected}
    references = {**REFERENCES, **SLOW_REFERENCES}
    run_here([_job(workdir, name, *references[name])
              for name in sorted({case[2] for case in layouts.values()} & set(references))])
    for world in (2, 4):
        run_pool(world, [_job(workdir, name, BATCH, extra)
                         for name, (ranks, extra, _) in layouts.items() if ranks == world])
    return workdir


ALL_LAYOUTS = {**LAYOUTS, **SLOW_LAYOUTS}


@pytest.mark.parametrize("name", marked_slow([n for n, case in ALL_LAYOUTS.items() if case[2]], SLOW_LAYOUTS))
def test_v_schedule_trains_like_one_process(v_runs, name):
    reference = ALL_LAYOUTS[name][2]
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
    (start, *_) = initial_weights(v_runs, reference)
    assert max((want_weights[k] - start[k]).abs().max().item() for k in start) > 100 * FINAL_ATOL
    if reference in ("moe_ref", "moe_ep2_1f1b_pp2"):  # the load-balancing loss was on, and is reported alike
        assert losses(v_runs, name, "aux_loss") == pytest.approx(losses(v_runs, reference, "aux_loss"), rel=RTOL)
    if reference == "deepseek_ref":  # the score biases moved the same way: the same expert loads every step
        key = "expert_load_max_mean"
        assert losses(v_runs, name, key) == pytest.approx(losses(v_runs, reference, key), rel=RTOL)

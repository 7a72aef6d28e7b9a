"""Session fixtures of the parallelism tests: the workspace (seed weights, tokens, single-process references) and
the layouts' runs, each pool of ranks launched once for all the layouts it runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import BATCH, Case, run_pool, tiny_run, write_seed_weights, write_tokens

# The single-process references: batch_size x dp sequences per step is exactly what dp ranks read together
# (the loader gives rank r the r-th batch_size slice of each global batch).
REFERENCES = {"ref_b4": BATCH, "ref_b8": 2 * BATCH, "ref_b16": 4 * BATCH}

TWO_RANKS = [
    Case("fsdp", [], "ref_b8"),
    Case("dp_replicated", ["--parallel.fsdp=false"], "ref_b8"),
    Case("tp", ["--parallel.tp_degree=2"], "ref_b4"),
    Case("pp_gpipe", ["--parallel.pp_degree=2", "--parallel.pp_schedule=GPipe"], "ref_b4"),
    Case("pp_1f1b", ["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"], "ref_b4"),
    Case("pp_interleaved_1f1b", ["--parallel.pp_degree=2", "--parallel.pp_schedule=Interleaved1F1B"], "ref_b4"),
    # Gradient accumulation under PP: two loader batches of 2 become the 4 microbatches of one step.
    Case("pp_1f1b_grad_accum", ["--parallel.pp_degree=2", "--training.batch_size=2",
                                "--training.gradient_accumulation_steps=2"], "ref_b4"),
    Case("fsdp_ac_full", ["--activation_checkpoint.mode=full"], "ref_b8"),
    Case("fsdp_ac_selective", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_every=2"],
         "ref_b8"),
    Case("fsdp_ac_selective_ops", ["--activation_checkpoint.mode=selective",
                                   "--activation_checkpoint.selective_ops=true"], "ref_b8"),
    Case("fsdp_cpu_offload", ["--parallel.cpu_offload=true"], "ref_b8"),
    Case("fsdp_compile", ["--compile.enable=true"], "ref_b8"),
]

FOUR_RANKS = [
    Case("fsdp2_tp2", ["--parallel.tp_degree=2"], "ref_b8"),
    Case("fsdp2_pp2", ["--parallel.pp_degree=2"], "ref_b8"),
    Case("hsdp2x2", ["--parallel.dp_replicate=2"], "ref_b16"),
    Case("tp2_pp2", ["--parallel.tp_degree=2", "--parallel.pp_degree=2"], "ref_b4"),
]

CASES = {case.name: case for case in TWO_RANKS + FOUR_RANKS}


@pytest.fixture(scope="session")
def parallel_workspace(tmp_path_factory) -> Path:
    """Seed weights, a token file and the single-process reference runs (one process, run one after another)."""
    workdir = tmp_path_factory.mktemp("parallel")
    write_tokens(workdir / "tokens.jsonl")
    write_seed_weights(workdir / "seed.pt")
    run_pool(1, [tiny_run(workdir, name, batch_size=batch) for name, batch in REFERENCES.items()])
    return workdir


@pytest.fixture(scope="session")
def layout_runs(parallel_workspace: Path) -> Path:
    """Every layout of CASES trained for 10 steps: one 2-rank pool and one 4-rank pool."""
    for world, cases in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        run_pool(world, [tiny_run(parallel_workspace, case.name) + case.overrides for case in cases])
    return parallel_workspace

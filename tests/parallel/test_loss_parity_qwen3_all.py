"""Qwen3 in the layouts that do not depend on the model (data-parallel replication, the pipeline schedules,
checkpointing modes, CPU offload, HSDP, FSDP x PP) trains like one process. The default suite runs Qwen3 in the
layouts its differences from Llama meet (conftest.py's QWEN3_LAYOUTS); these take another minute of launches on a
small machine, so they run with `pytest -m slow tests/parallel`."""

from __future__ import annotations

import pytest

from .conftest import BATCHES, LLAMA_FOUR_RANKS, LLAMA_TWO_RANKS, QWEN3_LAYOUTS, REFERENCES, qwen3
from .harness import STEPS, losses, run_pool, tiny_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TWO = [qwen3(case) for case in LLAMA_TWO_RANKS if case.name not in QWEN3_LAYOUTS]
FOUR = [qwen3(case) for case in LLAMA_FOUR_RANKS if case.name not in QWEN3_LAYOUTS]
CASES = {case.name: case for case in TWO + FOUR}


@pytest.fixture(scope="module")
def qwen3_runs(parallel_workspace):
    """The single-process references the default suite does not run, then the layouts (one pool per size)."""
    extra = {case.reference_run: (BATCHES[case.reference], case.model) for case in CASES.values()}
    run_pool(1, [tiny_run(parallel_workspace, name, batch, model)
                 for name, (batch, model) in sorted(extra.items()) if name not in REFERENCES])
    run_pool(2, [tiny_run(parallel_workspace, case.name, model=case.model) + case.overrides for case in TWO])
    run_pool(4, [tiny_run(parallel_workspace, case.name, model=case.model) + case.overrides for case in FOUR])
    return parallel_workspace


@pytest.mark.parametrize("name", list(CASES))
def test_qwen3_layout_losses_match_single_process(qwen3_runs, name):
    case = CASES[name]
    got, want = losses(qwen3_runs, name), losses(qwen3_runs, case.reference_run)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=1e-5), f"{name} vs {case.reference_run}:\n{got}\n{want}"

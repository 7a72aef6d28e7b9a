"""3-D parallelism (FSDP 2 x TP 2 x PP 2 on 8 gloo ranks) trains like one process. Eight processes on a small
machine take minutes, so this runs with `pytest -m slow tests/parallel`, not in the default suite."""

from __future__ import annotations

import pytest

from .harness import STEPS, losses, reference_name, run_pool, tiny_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# name: (model, overrides); each layout for Llama 3 and for Qwen3, untied (pipeline parallelism refuses a tied output).
LAYOUTS = {
    "fsdp2_tp2_pp2": ("llama3", ["--parallel.tp_degree=2", "--parallel.pp_degree=2"]),
    "fsdp2_tp2_pp2_interleaved_ac_compile": ("llama3", ["--parallel.tp_degree=2", "--parallel.pp_degree=2",
                                                        "--parallel.pp_schedule=Interleaved1F1B",
                                                        "--activation_checkpoint.mode=full", "--compile.enable=true"]),
}
LAYOUTS.update({f"qwen3_{name}": ("qwen3_untied", overrides) for name, (_, overrides) in LAYOUTS.items()})


@pytest.fixture(scope="module")
def three_d_runs(parallel_workspace):
    run_pool(8, [tiny_run(parallel_workspace, name, model=model) + overrides
                 for name, (model, overrides) in LAYOUTS.items()])
    return parallel_workspace


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_three_d_layout_losses_match_single_process(three_d_runs, name):
    got, want = losses(three_d_runs, name), losses(three_d_runs, reference_name(LAYOUTS[name][0], "ref_b8"))
    assert len(got) == STEPS
    assert got == pytest.approx(want, rel=1e-5)

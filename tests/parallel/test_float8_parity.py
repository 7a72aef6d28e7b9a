"""float8 under FSDP 2 x tensor parallel 2 trains like one float8 process (torchao's emulation: float8 casts,
high-precision matmuls), to float8's tolerance rather than to fp32's; gpt-oss with its experts in float8 too
(float8.moe_experts, emulated MXFP8) under FSDP 2 x expert parallel 2 likewise (measured 1.4e-3 relative over the 10
steps, 7e-4 at the first: the dense linears' tensorwise scales see each rank's batch; float8's own distance from the
fp32 run 1.8e-3).

Dynamic scaling takes each scale from the tensor being cast, and a data-parallel rank casts its own micro-batch: a
tensorwise activation scale is the amax of the rank's 4 sequences, not of the global 8, so the roundings differ
from one process's from the first forward on (step 1: 4e-4 relative). A rowwise scale belongs to one token, so the
first forward matches one process's to fp32 noise (measured 4e-8); the backward's casts along the tokens (the
weight gradient's) again see the rank's batch. Measured over the 10 steps: 1.2e-3 (tensorwise) and 3.7e-4
(rowwise) relative, the size of float8's own distance from the fp32 run (1.3e-3, 1.1e-3). A wrong shard or scale
moves the losses by far more than 5e-3; the plain fp32 layouts match to 1e-5 (test_loss_parity.py).
"""

from __future__ import annotations

import pytest

from .conftest import FLOAT8_CASES, FLOAT8_MOE_CASES
from .harness import STEPS, losses, marked_slow, reference_name

pytestmark = pytest.mark.distributed

RTOL = 5e-3
ROWWISE_FIRST_STEP_RTOL = 1e-6


# With -m slow: gloo carries no float8, so on the CPU these layouts run the emulated conversion with high-precision
# collectives; the conversion, the refusals, the 100-step loss curve and resume run by default (tests/trainer,
# tests/checkpoint), and the float8 collectives need an NCCL run (docs/float8.md). gpt-oss with float8 experts under
# FSDP 2 x ep 2 (10-15 s of 2-rank steps on 2 shared cores): the experts' own tests run by default
# (tests/trainer/test_float8_moe.py).
@pytest.mark.parametrize("name", marked_slow([*FLOAT8_CASES, *FLOAT8_MOE_CASES], [*FLOAT8_CASES, *FLOAT8_MOE_CASES])
                         or [pytest.param("float8", marks=pytest.mark.skip("no torchao"))])
def test_float8_layout_follows_one_float8_process(layout_runs, name):
    case = {**FLOAT8_CASES, **FLOAT8_MOE_CASES}[name]
    got, want = losses(layout_runs, name), losses(layout_runs, case.reference_run)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {case.reference_run}:\n{got}\n{want}"
    if "rowwise" in name:
        assert got[0] == pytest.approx(want[0], rel=ROWWISE_FIRST_STEP_RTOL)
    assert got != losses(layout_runs, reference_name(case.model, "ref_b8"))  # float8's rounding reached the losses

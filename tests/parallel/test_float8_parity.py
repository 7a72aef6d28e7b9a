"""float8 under FSDP 2 x tensor parallel 2 trains like one float8 process (torchao's emulation: float8 casts,
high-precision matmuls), to float8's tolerance rather than to fp32's.

Measured over the 10 steps: the layout's losses within 1.2e-3 (relative) of one float8 process's, which are
themselves 1.3e-3 from the fp32 run's. A float8 cast rounds to 3 mantissa bits, so a sum taken in another order
(the tensor-parallel partial sums, the sequence-parallel norms) that lands across a rounding boundary moves a value
by a whole float8 step; the plain fp32 layouts match to 1e-5 (test_loss_parity.py). A wrong shard or scale moves
the losses by far more than 5e-3.
"""

from __future__ import annotations

import pytest

from .conftest import FLOAT8_CASES
from .harness import STEPS, losses

pytestmark = pytest.mark.distributed

RTOL = 5e-3


@pytest.mark.parametrize("name", list(FLOAT8_CASES) or [pytest.param("float8", marks=pytest.mark.skip("no torchao"))])
def test_float8_layout_follows_one_float8_process(layout_runs, name):
    case = FLOAT8_CASES[name]
    got, want = losses(layout_runs, name), losses(layout_runs, case.reference_run)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {case.reference_run}:\n{got}\n{want}"
    assert got != losses(layout_runs, "ref_b8")  # float8's rounding reached the losses

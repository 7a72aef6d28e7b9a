"""`titan-npu plan` does not model mixture-of-experts models yet: it refuses one with a one-line error rather
than sizing its experts as dense weights."""

from pathlib import Path

import pytest

from titan_npu.errors import ConfigError
from titan_npu.planner.plan import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_plan_refuses_a_moe_model_and_says_so():
    with pytest.raises(ConfigError, match="does not model mixture-of-experts") as error:
        main(["--config", str(CONFIGS / "debug_moe.toml"), "--nodes", "1", "--devices-per-node", "8"])
    assert "\n" not in str(error.value)


"""Checks made before the process group exists: unusable dtypes, and torchrun restarts that could not re-form it."""

from __future__ import annotations

import pytest

from titan_npu.errors import ConfigError
from titan_npu.reliability.preflight import check_dtype_support, restart_problem


def test_fp16_on_a_cpu_is_refused_and_fp32_or_bf16_are_not():
    with pytest.raises(ConfigError, match=r"training.dtype = fp16 on a CPU: .* use training.dtype = fp32"):
        check_dtype_support("fp16", "cpu")
    check_dtype_support("fp32", "cpu")
    check_dtype_support("bf16", "cpu")


def test_restarts_over_torchruns_shared_store_are_named_with_the_fix_only_on_several_nodes():
    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2"}
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun" in restart_problem(shared)
    # One node: every rank has the same restart count, which scopes the process group's keys.
    assert restart_problem({**shared, "GROUP_WORLD_SIZE": "1"}) == ""
    assert restart_problem({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) == ""
    assert restart_problem({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) == ""
    assert restart_problem({}) == ""

"""Fault injection lives in the tests: the package reads no fault switch, the tests install hooks on the Trainer."""

from __future__ import annotations

from pathlib import Path

from fault_hooks import Faults

PACKAGE = Path(__file__).resolve().parents[2] / "titan_npu"


def test_the_package_reads_no_fault_injection_variables():
    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "TITAN_FAULT" in p.read_text()]
    assert readers == []


def test_faults_come_from_the_tests_environment_for_one_rank_and_only_the_nan_in_a_restarted_attempt():
    env = {"TITAN_FAULT_NAN_AT_STEP": "3", "TITAN_FAULT_KILL_AT_STEP": "5", "TITAN_FAULT_RANK": "1"}
    assert Faults.from_env(1, env) == Faults(nan_at=3, kill_at=5)
    assert Faults.from_env(0, env) == Faults()
    assert Faults.from_env(1, {**env, "TORCHELASTIC_RESTART_COUNT": "1"}) == Faults(nan_at=3)

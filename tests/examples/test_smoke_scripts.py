"""examples/smoke_common.sh, which both device smoke tests source: its output folder and the package it imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source_common(out: Path, then: str = "true") -> subprocess.CompletedProcess:
    """Source smoke_common.sh in the repository root with OUT set, then run `then`; without any PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` is this one
    script = f'cd "{ROOT}" && OUT="{out}" && source examples/smoke_common.sh && {then}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)


def test_a_folder_the_smoke_test_did_not_make_is_never_deleted(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    proc = _source_common(out)
    assert proc.returncode == 2
    assert "was not made by a smoke test" in proc.stderr
    assert (out / "precious.txt").read_text() == "keep"


def test_an_earlier_smoke_runs_logs_are_replaced_and_a_new_folder_is_made(tmp_path):
    out = tmp_path / "smoke"
    assert _source_common(out).returncode == 0  # made here
    (out / "old.log").write_text("from the last run")
    assert _source_common(out).returncode == 0
    assert not (out / "old.log").exists() and (out / ".titan_smoke_logs").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _source_common(empty).returncode == 0


def test_the_stages_import_this_checkouts_package_from_any_folder(tmp_path):
    # examples/op_check.py runs with examples/ as its first import path: the package must come from PYTHONPATH,
    # not from an install that may be absent (or another checkout's).
    proc = _source_common(tmp_path / "smoke", 'cd examples && python -c "import titan_npu; print(titan_npu.__file__)"')
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == ROOT / "titan_npu" / "__init__.py"

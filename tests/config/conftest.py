"""Shared fixtures of the config tests."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def config_files() -> list[Path]:
    """Every config that ships in configs/."""
    files = sorted(p for p in CONFIGS.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))
    assert files, f"no configs found in {CONFIGS}"
    return files

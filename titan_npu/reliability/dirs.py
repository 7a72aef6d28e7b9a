"""Folders a run writes to (checkpoint.dir, metrics.log_dir): checked before anything is built, nothing created."""

from __future__ import annotations

import os
from pathlib import Path

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError


def folder_problem(path: str | Path) -> str:
    """Why a folder cannot be created or written at `path` ("" when it can); looks only, creates nothing."""
    target = Path(path).expanduser().absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return ""


def check_output_folders(cfg: JobConfig) -> None:
    """ConfigError naming the key, the path and the fix when checkpoint.dir or metrics.log_dir is unusable."""
    folders = [("metrics.log_dir", cfg.metrics.log_dir)]
    if cfg.checkpoint.enable:
        folders.insert(0, ("checkpoint.dir", cfg.checkpoint.dir))
    for key, path in folders:
        problem = folder_problem(path)
        if problem:
            raise ConfigError(f"{key} = {path} cannot be created or written: {problem}; "
                              f"pass --{key} a folder this user can create or write")

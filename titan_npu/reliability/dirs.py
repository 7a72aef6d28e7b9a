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
    kind = virtual_filesystem(existing)
    if kind:
        return f"{existing} is on the {kind} filesystem, which the kernel makes up and which cannot hold files"
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


# Filesystems whose entries the kernel makes up: nothing written there is kept (or writing fails oddly).
_VIRTUAL = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "securityfs", "debugfs", "tracefs", "pstore", "bpf",
            "configfs", "efivarfs", "fusectl", "mqueue", "binfmt_misc", "nsfs", "selinuxfs", "rpc_pipefs",
            "hugetlbfs"}


def virtual_filesystem(path: str | Path) -> str:
    """The type of the kernel-made filesystem (proc, sysfs ...) that holds `path`, or "" for one that holds files."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                mount = fields[4].replace("\\040", " ")
                fstype = line.split(" - ", 1)[1].split()[0]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fstype
    except OSError:  # no /proc (not Linux): nothing known
        return ""
    return kind if kind in _VIRTUAL else ""

"""Folders a run writes to (checkpoint.dir, metrics.log_dir): checked before anything is built, nothing created.

Beyond being writable, neither may be or lie inside a checkpoint, a prepared dataset or an export, and the run never
replaces a file it did not write (outputs.py's rule): in metrics.log_dir the files of the names it writes
(config.toml, metrics.jsonl, ...) are the run's only where its marker (or an earlier run's run_info.json) says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_npu import outputs
from titan_npu.config.loader import save_config
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
    # What the folders hold is rank 0's to judge: it writes them, and another rank of the same job could look while
    # rank 0 (already started) writes a step or the run's config.toml.
    if os.environ.get("RANK", "0") in ("", "0"):
        check_output_contents(cfg)


def check_output_contents(cfg: JobConfig) -> None:
    """ConfigError when the run would write into a checkpoint, a prepared dataset or an export, or replace a file
    it did not write (also what a dry run checks: it reads the folders, whether or not this machine can write)."""
    folders = [("metrics.log_dir", cfg.metrics.log_dir)]
    if cfg.checkpoint.enable:
        folders.insert(0, ("checkpoint.dir", cfg.checkpoint.dir))
    for key, path in folders:
        outputs.refuse_protected(f"{key} =", Path(path), ConfigError, fix=f"pass --{key} a folder outside it")
    check_log_dir(Path(cfg.metrics.log_dir))
    if cfg.checkpoint.enable:
        check_checkpoint_dir(Path(cfg.checkpoint.dir))
    if cfg.profiling.enable:
        outputs.refuse_protected("profiling.trace_dir =", Path(cfg.profiling.trace_dir), ConfigError,
                                 fix="pass --profiling.trace_dir a folder outside it")


def check_log_dir(log_dir: Path) -> None:
    """ConfigError when the files a run writes into metrics.log_dir would replace ones it did not write (a config
    the user keeps there, their own metrics.jsonl): the log dir of an earlier run, resumed or not, is the run's."""
    outputs.refuse_foreign_names("metrics.log_dir =", log_dir, outputs.RUN_LOG_FILES,
                                 outputs.run_log_files_ours(log_dir), ConfigError, "a training run",
                                 f"move it away or pass --metrics.log_dir another folder, e.g. {log_dir / 'logs'}")


def start_log_dir(cfg: JobConfig) -> None:
    """Rank 0, before the run writes anything else there: mark which files of metrics.log_dir are the run's
    (check_log_dir), then write the resolved config.toml, recording its digest (edited later, it is the user's)."""
    log_dir = Path(cfg.metrics.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    outputs.write_marker(log_dir, "train", outputs.RUN_LOG_FILES)
    save_config(cfg, log_dir / "config.toml")
    outputs.write_marker(log_dir, "train", outputs.RUN_LOG_FILES,
                         digests={"config.toml": outputs.file_digest(log_dir / "config.toml")})


def check_checkpoint_dir(root: Path) -> None:
    """ConfigError when checkpoint.dir holds an entry named like a checkpoint (step-N) that is not one: a save of
    that step would replace it."""
    foreign = outputs.foreign_step_names(root)
    if foreign:
        step = foreign[0].removeprefix("step-")
        raise ConfigError(f"checkpoint.dir = {root} holds {foreign[0]}, which is not a checkpoint: the save of step "
                          f"{step} would replace it; move it away or pass --checkpoint.dir another folder")


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

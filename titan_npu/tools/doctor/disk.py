"""Free disk where checkpoints and logs go, and host RAM for async checkpoint staging, against the config."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from titan_npu.tools.doctor.report import Report


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(report: Report, cfg) -> dict:
    """Free disk where checkpoints and logs go against what the config will write there."""
    from titan_npu.planner.layout import GiB, job_from_config
    from titan_npu.planner.parameters import checkpoint_bytes

    s = "disk"
    facts: dict = {}
    ck = cfg.checkpoint
    if not ck.enable:
        report.add("info", s, "checkpointing is off (checkpoint.enable = false)")
    else:
        size = checkpoint_bytes(job_from_config(cfg))
        kept = ck.keep_last_n + 1 if ck.keep_last_n > 0 else None  # a new save lands before the oldest is deleted
        where = _existing_parent(Path(ck.dir))
        free = shutil.disk_usage(where).free
        facts.update(checkpoint_bytes=size, free_bytes=free, path=str(where))
        if kept is None:
            report.add("warn", s, f"checkpoint.keep_last_n = {ck.keep_last_n} keeps every checkpoint: "
                                  f"{size / GiB:.1f} GiB each; {free / GiB:.1f} GiB free at {where}")
        else:
            need = size * kept
            level = "ok" if free >= need else "fail"
            msg = (f"checkpoints at {ck.dir}: {size / GiB:.1f} GiB each (fp32 weights + optimizer), up to {kept} at "
                   f"once = {need / GiB:.1f} GiB; {free / GiB:.1f} GiB free on {where}")
            if level == "fail":
                msg += " -- free space, point checkpoint.dir elsewhere, or lower checkpoint.keep_last_n"
            report.add(level, s, msg)
        if ck.async_save:
            ram = _available_ram()
            local_share = size * int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // int(os.environ.get("WORLD_SIZE", "1"))
            if ram and local_share > ram:
                report.add("warn", s, f"async checkpoint staging needs ~{local_share / GiB:.1f} GiB of host RAM on "
                                      f"this node, {ram / GiB:.1f} GiB available; set checkpoint.async_save = false")
    logs = _existing_parent(Path(cfg.metrics.log_dir))
    free_logs = shutil.disk_usage(logs).free
    report.add("ok" if free_logs > 1024**3 else "warn", s,
               f"logs at {cfg.metrics.log_dir}: {free_logs / 1024**3:.1f} GiB free on {logs}")
    return facts


def _available_ram() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"MemAvailable:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else None

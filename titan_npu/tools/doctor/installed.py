"""What is installed outside Python: where the CANN toolkit is, and the CANN, NPU driver and NVIDIA driver versions."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


def ascend_toolkit_home() -> Path | None:
    """Where CANN's toolkit is: ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH (set by set_env.sh), else the default path."""
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        value = os.environ.get(var)
        if value and Path(value).is_dir():
            return Path(value)
    for default in ("/usr/local/Ascend/ascend-toolkit/latest", str(Path.home() / "Ascend/ascend-toolkit/latest")):
        if Path(default).is_dir():
            return Path(default)
    return None


def read_cann_version(home: Path) -> str | None:
    """CANN version from the toolkit's version files (version.cfg, *_install.info, compiler/runtime version.info)."""
    candidates = [home / "version.cfg", *sorted(home.glob("*/ascend_toolkit_install.info")),
                  home / "compiler" / "version.info", home / "runtime" / "version.info",
                  home / "toolkit" / "version.info"]
    for path in candidates:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        # version.cfg: runtime_running_version=[7.0.0.5.242:8.0.RC1]; *.info: version=8.0.RC1 / Version=8.0.RC1
        m = re.search(r"running_version=\[[^:\]]*:([^\]]+)\]", text) or re.search(
            r"^\s*(?:version|Version)\s*=\s*([0-9][\w.]*)", text, re.MULTILINE)
        if m:
            return m.group(1).strip()
    return None


def read_npu_driver_version(driver_dir: Path = Path("/usr/local/Ascend/driver")) -> str | None:
    """NPU driver version from driver/version.info, else from `npu-smi info`'s header."""
    try:
        m = re.search(r"^\s*Version\s*=\s*([0-9][\w.]*)", (driver_dir / "version.info").read_text(errors="replace"),
                      re.MULTILINE)
        if m:
            return m.group(1)
    except OSError:
        pass
    out = _run(["npu-smi", "info"])
    if out:
        m = re.search(r"Version:\s*([0-9][\w.]*)", out)
        if m:
            return m.group(1)
    return None


def read_nvidia_driver() -> tuple[str | None, str | None]:
    """(driver version, highest CUDA version the driver supports) from nvidia-smi, or (None, None)."""
    out = _run(["nvidia-smi"])
    if not out:
        return None, None
    driver = re.search(r"Driver Version:\s*([\d.]+)", out)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
                              check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None

"""The software stack's versions and whether they belong together: torch, torch_npu, CANN and the drivers."""

from __future__ import annotations

import platform
import re
import sys

from titan_npu.tools.doctor.installed import (
    ascend_toolkit_home,
    read_cann_version,
    read_npu_driver_version,
    read_nvidia_driver,
)
from titan_npu.tools.doctor.report import Report

# torch_npu release -> the CANN release it was built for (Ascend's compatibility table, main releases; the rows the
# torch_npu wheels ship in their README are checked against this table by tests/npu/test_npu_versions.py).
# 2.13.0 and 2.14.0 are in no table they ship: both are built from one source tree (2.13.0's README: "supported on
# this branch: 2.13.0, 2.14.0, 2.15.0"), and 2.14.0's README installs CANN 9.1.0, the stricter of the two READMEs
# (2.13.0's table ends at CANN 8.5.0), which docs/npu.md explains.
TORCH_NPU_CANN: dict[str, str] = {
    "2.14.0": "9.1.0", "2.13.0": "9.1.0",
    "2.12.0": "9.1.0", "2.11.0": "9.1.0", "2.10.0.post4": "9.1.0", "2.9.0.post6": "9.1.0", "2.7.1.post8": "9.1.0",
    "2.10.0": "9.0.0", "2.9.0.post2": "9.0.0", "2.8.0.post4": "9.0.0", "2.7.1.post4": "9.0.0",
    "2.9.0": "8.5.0", "2.8.0.post2": "8.5.0", "2.7.1.post2": "8.5.0", "2.6.0.post5": "8.5.0",
    "2.8.0": "8.3.RC1", "2.7.1": "8.3.RC1", "2.6.0.post3": "8.3.RC1", "2.1.0.post17": "8.3.RC1",
    "2.6.0": "8.2.RC1", "2.5.1.post1": "8.2.RC1", "2.1.0.post13": "8.2.RC1",
    "2.5.1": "8.1.RC1", "2.4.0.post4": "8.1.RC1", "2.3.1.post6": "8.1.RC1",
    "2.4.0.post2": "8.0.0", "2.3.1.post4": "8.0.0", "2.1.0.post10": "8.0.0",
    "2.4.0": "8.0.RC3", "2.3.1.post2": "8.0.RC3", "2.1.0.post8": "8.0.RC3",
    "2.3.1": "8.0.RC2", "2.2.0.post2": "8.0.RC2", "2.1.0.post6": "8.0.RC2",
    "2.2.0": "8.0.RC1", "2.1.0.post4": "8.0.RC1", "2.1.0.post3": "8.0.RC1",
    "2.1.0.post12": "8.1.RC1", "2.1.0": "7.0.0", "2.0.1.post1": "7.0.0", "2.1.0.rc1": "7.0.RC1", "2.0.1": "7.0.RC1",
}

# CANN release -> the NPU driver release it shipped with; an older driver than this is not supported by it.
CANN_DRIVER: dict[str, str] = {
    "8.0.RC1": "24.1.RC1", "8.0.RC2": "24.1.RC2", "8.0.RC3": "24.1.RC3", "8.0.0": "24.1.0",
    "8.1.RC1": "25.0.RC1", "8.2.RC1": "25.2.0", "8.3.RC1": "25.3.RC1", "8.5.0": "25.5.0",
}


def parse_release(version: str) -> tuple:
    """'8.0.RC2' -> (8, 0, -1, 2), '8.0.0' -> (8, 0, 0), '24.1.rc2' -> (24, 1, -1, 2): RCs sort before the release."""
    parts: list[int] = []
    for piece in version.strip().lower().split("."):
        m = re.fullmatch(r"rc(\d+)", piece)
        if m:
            parts += [-1, int(m.group(1))]
        elif piece.isdigit():
            parts.append(int(piece))
        else:
            digits = re.match(r"\d+", piece)
            if digits:
                parts.append(int(digits.group()))
            break
    return tuple(parts)


def release_for(table: dict[str, str], version: str | None) -> str | None:
    """The table's entry for a version, matching releases by prefix ('8.0.RC2.alpha003' finds '8.0.RC2')."""
    if not version:
        return None
    parsed = parse_release(version)
    for key, value in table.items():
        k = parse_release(key)
        if parsed[: len(k)] == k:
            return value
    return None


def _torch_npu_pairing(torch_version: str, torch_npu_version: str) -> tuple[str, str]:
    """The device layer's torch / torch_npu rule (what device setup refuses, the doctor reports as a failure)."""
    from titan_npu.device.npu import check_torch_npu_version, release
    from titan_npu.errors import DeviceError

    try:
        check_torch_npu_version(torch_version, torch_npu_version)
    except DeviceError as e:
        return "fail", str(e)
    if not release(torch_version) or not release(torch_npu_version):
        return "info", (f"torch_npu {torch_npu_version} and torch {torch_version}: no X.Y.Z release in one of "
                        "them, so their pairing is not checked")
    return "ok", f"torch_npu {torch_npu_version} matches torch {release(torch_version)}"


def stack_findings(versions: dict[str, str | None], cann_home: str | None = None) -> list[tuple[str, str]]:
    """(level, message) for each component of the stack and each pair of versions that must belong together.

    versions: torch, torch_cuda, torch_npu, cann, npu_driver, nvidia_driver, nvidia_cuda (None = not present).
    """
    out: list[tuple[str, str]] = []
    torch_v, npu, cann, driver = (versions.get(k) for k in ("torch", "torch_npu", "cann", "npu_driver"))
    torch_cuda = versions.get("torch_cuda")
    from titan_npu.device.npu import MIN_TORCH

    if torch_v and parse_release(torch_v)[:2] < parse_release(MIN_TORCH)[:2]:
        out.append(("fail", f"torch {torch_v} is older than {MIN_TORCH}, the oldest titan-npu runs on; install torch "
                            f">= {MIN_TORCH} (with the torch_npu of the same version on Ascend)"))
    else:
        out.append(("ok", f"torch {torch_v}" + (f" (CUDA {torch_cuda})" if torch_cuda else "")))
    if npu is None:
        out.append(("info", "torch_npu not installed (needed only for Ascend NPUs)"))
    else:
        out.append(_torch_npu_pairing(torch_v or "", npu))
    if cann_home is None:
        if npu is not None:
            out.append(("fail", "CANN toolkit not found: source /usr/local/Ascend/ascend-toolkit/set_env.sh "
                                "(it sets ASCEND_TOOLKIT_HOME) before training"))
    else:
        out.append(("ok" if cann else "warn", f"CANN {cann or 'version unknown'} at {cann_home}"))
    if npu and cann:
        expected = TORCH_NPU_CANN.get(npu)
        if expected is None:
            out.append(("info", f"torch_npu {npu} is not in the compatibility table; check Ascend's table for the "
                                "CANN it needs"))
        elif release_for({expected: expected}, cann) is None:
            out.append(("warn", f"torch_npu {npu} was released for CANN {expected}, installed is CANN {cann}; "
                                f"mismatches fail at import or inside HCCL -- install CANN {expected} or the "
                                f"torch_npu release for CANN {cann}"))
        else:
            out.append(("ok", f"torch_npu {npu} belongs to CANN {cann}"))
    if driver:
        out.append(("ok", f"NPU driver {driver}"))
        needed = release_for(CANN_DRIVER, cann)
        if needed and parse_release(driver) < parse_release(needed):
            out.append(("fail", f"NPU driver {driver} is older than {needed}, which CANN {cann} needs; upgrade "
                                f"firmware and driver to {needed} or later (HCCL/RDMA init errors otherwise)"))
    elif npu is not None:
        out.append(("warn", "NPU driver version unknown (no /usr/local/Ascend/driver/version.info, no npu-smi)"))
    nv_driver, nv_cuda = versions.get("nvidia_driver"), versions.get("nvidia_cuda")
    if nv_driver:
        out.append(("ok", f"NVIDIA driver {nv_driver} (supports CUDA up to {nv_cuda})"))
        if torch_cuda and nv_cuda and parse_release(torch_cuda) > parse_release(nv_cuda):
            out.append(("fail", f"torch is built for CUDA {torch_cuda} but the driver supports CUDA up to "
                                f"{nv_cuda}; upgrade the driver or install a torch built for CUDA <= {nv_cuda}"))
    return out


def check_versions(report: Report) -> dict[str, str | None]:
    """Versions of the stack and whether they belong together; returns them for the cross-rank comparison."""
    import torch

    # Package metadata, not an import: a broken torch_npu must not crash the doctor (it is imported below).
    from titan_npu.device.npu import installed_torch_npu_version

    s = "versions"
    py = platform.python_version()
    report.add("ok" if sys.version_info >= (3, 10) else "fail", s,
               f"python {py}" + ("" if sys.version_info >= (3, 10) else " (titan-npu needs 3.10 or later)"))
    home = ascend_toolkit_home()
    nv_driver, nv_cuda = read_nvidia_driver()
    versions: dict[str, str | None] = {
        "python": py, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "torch_npu": installed_torch_npu_version(), "cann": read_cann_version(home) if home else None,
        "npu_driver": read_npu_driver_version(), "nvidia_driver": nv_driver, "nvidia_cuda": nv_cuda,
    }
    for level, message in stack_findings(versions, str(home) if home else None):
        report.add(level, s, message)
    if versions["torch_npu"] is not None:
        try:
            from titan_npu.device import import_torch_npu

            import_torch_npu(required=True)
        except Exception as e:  # a broken CANN install fails in many ways; the message says which
            report.add("fail", s, f"torch_npu does not import: {e}")
    return versions

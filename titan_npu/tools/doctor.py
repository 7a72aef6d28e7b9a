"""`titan-npu doctor`: is this machine (and, under torchrun, this job) ready to train?

    titan-npu doctor [--config C]                                    versions, devices, environment, disk
    torchrun --nnodes 2 --nproc_per_node 8 ... -m titan_npu.cli doctor  + collectives on the real backend

Checks the software stack (Python, torch, torch_npu, CANN, driver) and whether its versions belong together,
the visible devices, the HCCL/NCCL variables in effect and what they do, free disk where checkpoints go against
the size the config implies, and, under torchrun, all_reduce / all_gather / broadcast on the job's backend with
each rank's time and the bus bandwidth. A rank that never checks in, or never reaches a collective, is named by
rank number within --timeout seconds instead of hanging the job. Exit code 0: no failures; 1: something failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

LEVELS = ("ok", "info", "warn", "fail", "table")  # "table": a row of a table, printed without a tag

# torch_npu release -> the CANN release it was built for (Ascend's compatibility table, main releases; the rows the
# torch_npu wheel ships in its README are checked against this table by tests/npu/test_npu_versions.py).
TORCH_NPU_CANN: dict[str, str] = {
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

# What the collective libraries' variables do, for the environment listing.
ENV_MEANING: dict[str, str] = {
    "HCCL_CONNECT_TIMEOUT": "seconds HCCL waits for every rank to connect at init (default 120)",
    "HCCL_EXEC_TIMEOUT": "seconds HCCL's device-side tasks may wait for peers (default 1836); the collective "
                         "timeout itself is the process group's, comm.timeout_s",
    "HCCL_BUFFSIZE": "MB of device memory per communicator buffer (default 200; two per communicator)",
    "HCCL_IF_IP": "host IP HCCL uses for its out-of-band connection at init",
    "HCCL_SOCKET_IFNAME": "network interface(s) for HCCL's host-side sockets",
    "HCCL_WHITELIST_DISABLE": "1 = accept connections from any host (no trust list)",
    "HCCL_INTRA_ROCE_ENABLE": "1 = use RoCE instead of HCCS between cards of one node",
    "HCCL_INTRA_PCIE_ENABLE": "1 = use PCIe between cards of one node",
    "HCCL_ALGO": "collective algorithm per level (ring, H-D, NHR ...)",
    "HCCL_OP_EXPANSION_MODE": "where HCCL expands collectives (AI_CPU / AIV / HOST)",
    "HCCL_DETERMINISTIC": "true = reproducible reduction order (slower)",
    "HCCL_RDMA_TC": "RoCE traffic class (DSCP x 4) the switches must honour",
    "HCCL_RDMA_SL": "RoCE service level",
    "HCCL_RDMA_TIMEOUT": "RoCE retransmission timeout exponent (4.096us x 2^n)",
    "HCCL_RDMA_RETRY_CNT": "RoCE retransmissions before a link error",
    "TORCH_HCCL_ASYNC_ERROR_HANDLING": "1 = abort the process group on a collective error",
    "TORCH_HCCL_ENABLE_MONITORING": "1 = a monitor thread aborts the rank when the HCCL watchdog hangs",
    "TORCH_HCCL_DUMP_ON_TIMEOUT": "1 = dump the HCCL flight recorder when a collective times out",
    "TASK_QUEUE_ENABLE": "torch_npu task-queue level (2 = pipelined operator launch, the standard setting)",
    "CPU_AFFINITY_CONF": "1 = bind each rank's host threads to the cores near its card",
    "STREAMS_PER_DEVICE": "size of torch_npu's stream pool per card",
    "NCCL_DEBUG": "NCCL logging level (INFO shows the transports chosen)",
    "NCCL_SOCKET_IFNAME": "network interface(s) for NCCL's bootstrap and socket transport",
    "NCCL_IB_DISABLE": "1 = no InfiniBand/RoCE, TCP sockets only (slow)",
    "NCCL_IB_HCA": "which InfiniBand adapters NCCL uses",
    "NCCL_IB_GID_INDEX": "RoCE GID index (3 = RoCE v2 on most setups)",
    "NCCL_P2P_DISABLE": "1 = no NVLink/PCIe peer-to-peer between GPUs of a node",
    "NCCL_NET_GDR_LEVEL": "when GPUDirect RDMA is used",
    "NCCL_BUFFSIZE": "bytes per NCCL channel buffer (default 4 MiB)",
    "NCCL_ALGO": "forced collective algorithm",
    "NCCL_PROTO": "forced collective protocol",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1 = abort the process group on a collective error or timeout",
    "TORCH_NCCL_BLOCKING_WAIT": "1 = collectives block and raise on timeout",
    "GLOO_SOCKET_IFNAME": "network interface for gloo (CPU collectives, side channels)",
    "MASTER_ADDR": "host of the rendezvous store (rank 0 or the torchrun agent)",
    "MASTER_PORT": "port of the rendezvous store",
    "ASCEND_RT_VISIBLE_DEVICES": "NPUs this process may use (torch sees them as 0..n-1)",
    "CUDA_VISIBLE_DEVICES": "GPUs this process may use (torch sees them as 0..n-1)",
    "PYTORCH_NPU_ALLOC_CONF": "NPU caching-allocator options (expandable_segments:True limits fragmentation)",
    "PYTORCH_CUDA_ALLOC_CONF": "CUDA caching-allocator options",
}
ENV_PREFIXES = ("HCCL_", "NCCL_", "TORCH_NCCL_", "TORCH_HCCL_", "GLOO_", "TORCH_DISTRIBUTED_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
             "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "OMP_NUM_THREADS", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF",
             "STREAMS_PER_DEVICE")
IFNAME_VARS = ("HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass
class Finding:
    """One line of the report."""

    level: str  # ok | info | warn | fail
    section: str
    message: str


@dataclass
class Report:
    """Everything the doctor found, in order."""

    findings: list[Finding] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def add(self, level: str, section: str, message: str) -> None:
        self.findings.append(Finding(level, section, message))

    def count(self, level: str) -> int:
        return sum(1 for f in self.findings if f.level == level)

    def format(self, levels: tuple[str, ...] = LEVELS) -> str:
        lines, section = [], None
        for f in self.findings:
            if f.level not in levels:
                continue
            if f.section != section:
                section = f.section
                lines.append(section)
            if f.level == "table":
                lines.append(f"         {f.message}")
            else:
                lines.append(f"  [{f.level}]{' ' * (5 - len(f.level))}{f.message}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Versions


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
        m = re.search(r"^\s*Version\s*=\s*([0-9][\w.]*)", (driver_dir / "version.info").read_text(), re.MULTILINE)
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
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None


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


# ---------------------------------------------------------------------------------------------------------------
# Devices, environment, disk


def check_devices(report: Report) -> dict:
    """Which device type this process would train on, how many are visible, and their memory."""
    from titan_npu.device import detect_device_type, device_module
    from titan_npu.errors import DeviceError

    s = "devices"
    try:
        device_type = detect_device_type()
    except DeviceError as e:
        report.add("fail", s, str(e))
        return {"type": None, "count": 0}
    facts: dict = {"type": device_type, "count": 0, "names": []}
    mod = device_module(device_type)
    visible_var = "ASCEND_RT_VISIBLE_DEVICES" if device_type == "npu" else "CUDA_VISIBLE_DEVICES"
    if mod is None:
        report.add("info", s, f"no accelerator: training runs on cpu ({os.cpu_count()} cores, gloo backend)")
        return facts
    count = mod.device_count()
    facts["count"] = count
    for i in range(count):
        try:
            props = mod.get_device_properties(i)
            facts["names"].append(f"{mod.get_device_name(i)} ({props.total_memory / 1024**3:.0f} GiB)")
        except Exception:
            facts["names"].append(device_type)
    visible = os.environ.get(visible_var)
    report.add("ok" if count else "fail", s, f"{count} {device_type} device(s): {', '.join(facts['names']) or '-'}"
               f" ({visible_var}={visible if visible is not None else '<unset>'})")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > count:
        report.add("fail", s, f"torchrun starts {local_world} processes on this node but only {count} {device_type} "
                              f"device(s) are visible; lower --nproc_per_node or widen {visible_var}")
    return facts


def _interface_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces selected by a *_SOCKET_IFNAME value: comma list of prefixes, '^' excludes, '=' exact."""
    chosen = set()
    exclude = spec.startswith("^")
    entries = [e for e in spec.lstrip("^").split(",") if e]
    for entry in entries:
        exact = entry.startswith("=")
        entry = entry.lstrip("=")
        chosen |= {n for n in names if (n == entry if exact else n.startswith(entry))}
    return sorted(set(names) - chosen) if exclude else sorted(chosen)


def _is_local_address(ip: str) -> bool:
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
        return True
    except OSError:
        return False


def check_environment(report: Report, device_type: str | None, cfg=None) -> dict[str, str]:
    """The collective libraries' variables in effect, what each one does, and the settings known to bite."""
    s = "communication environment"
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    for name in sorted(env):
        meaning = ENV_MEANING.get(name, "")
        report.add("info", s, f"{name}={env[name]}" + (f"  -- {meaning}" if meaning else ""))
    if not env:
        report.add("info", s, "no HCCL_/NCCL_/GLOO_ variables set: the libraries' defaults apply")
    nodes = _node_count()
    connect = env.get("HCCL_CONNECT_TIMEOUT")
    if device_type == "npu" and nodes > 1 and connect and connect.isdigit() and int(connect) < 300:
        report.add("warn", s, f"HCCL_CONNECT_TIMEOUT={connect}s on a {nodes}-node job: nodes that start a few "
                              "minutes apart fail HCCL init; set it to 1800 (the [comm] init_timeout_s default)")
    exec_timeout = env.get("HCCL_EXEC_TIMEOUT")
    if exec_timeout and exec_timeout.isdigit() and 0 < int(exec_timeout) < 600:
        report.add("warn", s, f"HCCL_EXEC_TIMEOUT={exec_timeout}s: ranks waiting on a slow checkpoint save or data "
                              "read hit it (the 'timeout at step N' crash); 1800 leaves room")
    if env.get("NCCL_IB_DISABLE") == "1" and nodes > 1:
        report.add("warn", s, "NCCL_IB_DISABLE=1 on a multi-node job: inter-node traffic falls back to TCP sockets")
    names = [n for _, n in socket.if_nameindex()]
    for var in IFNAME_VARS:
        if var in env and not _interface_matches(env[var], names):
            report.add("fail", s, f"{var}={env[var]} matches no network interface here (have: {', '.join(names)}); "
                                  "set it to the interface of the cluster network")
    if "HCCL_IF_IP" in env and not _is_local_address(env["HCCL_IF_IP"]):
        report.add("fail", s, f"HCCL_IF_IP={env['HCCL_IF_IP']} is not an address of this host; set it per node to "
                              "this node's cluster-network IP")
    if cfg is not None and device_type:
        from titan_npu.device import communication_env

        for name, value in communication_env(device_type, cfg.comm).items():
            report.add("info", s, f"the run will set {name}={value} (from [comm]; your environment would win)")
    return env


def _node_count() -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return max(1, world // max(1, local))


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


# ---------------------------------------------------------------------------------------------------------------
# Collectives under torchrun


class RanksMissing(Exception):
    """Some ranks did not reach a meeting point before the deadline."""

    def __init__(self, where: str, missing: list[int], arrived_all: bool = False) -> None:
        self.where, self.missing, self.arrived_all = where, missing, arrived_all
        if arrived_all:
            text = (f"{where}: every rank arrived but the collective did not complete -- the transport between "
                    "nodes is broken (check *_SOCKET_IFNAME / HCCL_IF_IP, RoCE/IB links, firewall)")
        else:
            text = f"{where}: rank(s) {', '.join(map(str, missing))} did not answer"
        super().__init__(text)


def open_side_channel(rank: int, world_size: int, timeout_s: float):
    """A key-value store every rank reaches without the collective library: torchrun's agent store, or rank 0's."""
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    try:
        if agent or rank != 0:
            store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
        else:
            # Without torchrun's agent, rank 0 hosts the store and must not wait for the others to connect: a rank
            # that never comes is exactly what this check reports.
            store = dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    except Exception as e:
        host = "the torchrun agent" if agent else "rank 0"
        raise RanksMissing(f"store at {addr}:{port} ({host}) unreachable from rank {rank} ({type(e).__name__})",
                           [0] if not agent else []) from e
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"titan-doctor/{run}/{attempt}/", store)


def wait_for_keys(store, keys_by_rank: dict[int, str], deadline: float) -> list[int]:
    """Poll until every rank's key exists or the deadline passes; returns the ranks whose key is missing."""
    missing = dict(keys_by_rank)
    while missing:
        for r, key in list(missing.items()):
            if store.check([key]):
                del missing[r]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return sorted(missing)


def check_in(store, rank: int, world_size: int, payload: dict, timeout_s: float) -> dict[int, dict]:
    """Each rank announces itself; returns every rank's payload or raises RanksMissing naming the absent ranks."""
    store.set(f"checkin/{rank}", json.dumps(payload))
    missing = wait_for_keys(store, {r: f"checkin/{r}" for r in range(world_size)}, time.monotonic() + timeout_s)
    if missing:
        raise RanksMissing(f"check-in within {timeout_s:.0f}s", missing)
    return {r: json.loads(store.get(f"checkin/{r}")) for r in range(world_size)}


@dataclass
class CollectiveResult:
    """One collective at one size: each rank's mean time and the bandwidth it implies."""

    op: str
    size_bytes: int
    times_s: dict[int, float]

    @property
    def slowest_rank(self) -> int:
        return max(self.times_s, key=self.times_s.get)

    @property
    def time_s(self) -> float:
        return max(self.times_s.values())

    def algbw(self) -> float:
        return self.size_bytes / self.time_s

    def busbw(self) -> float:
        """Bus bandwidth (nccl-tests' convention): what each link carried, comparable across collectives."""
        n = len(self.times_s)
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "broadcast": 1.0}[self.op]
        return self.algbw() * factor

    def as_dict(self) -> dict:
        return {"op": self.op, "size_bytes": self.size_bytes, "times_s": self.times_s,
                "slowest_rank": self.slowest_rank, "algbw_gbs": self.algbw() / 1e9, "busbw_gbs": self.busbw() / 1e9}


COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


def _launch(op: str, tensor, out):
    import torch.distributed as dist

    if op == "all_reduce":
        return dist.all_reduce(tensor, async_op=True)
    if op == "all_gather":
        # all_gather_single is the newer name (torch >= 2.12) of all_gather_into_tensor.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(out, tensor, async_op=True)
    return dist.broadcast(tensor, src=0, async_op=True)


def run_collectives(store, rank: int, world_size: int, device, sizes: list[int], timeout_s: float,
                    iters: int = 3, ops: tuple[str, ...] = COLLECTIVES) -> list[tuple[str, int, float]]:
    """Time each op at each size on the joined process group; a rank that never arrives is named, not waited on.

    Before each (op, size) a rank sets an arrival key; when the first call does not complete within timeout_s,
    the ranks without an arrival key are the ones that did not answer.
    """
    import torch

    from titan_npu.device import synchronize

    done = []
    for i, (op, size) in enumerate((op, size) for op in ops for size in sizes):
        numel = max(world_size, size // 4 // world_size * world_size)
        tensor = torch.ones(numel if op != "all_gather" else numel // world_size, device=device.torch_device)
        out = torch.empty(numel, device=device.torch_device) if op == "all_gather" else None
        store.set(f"arrive/{i}/{rank}", "1")
        where = f"{op} of {_human(numel * 4)}"
        elapsed = []
        for it in range(iters + 1):  # the first call is a warm-up (connection set-up, buffers)
            synchronize(device)
            t0 = time.perf_counter()
            work = _launch(op, tensor, out)
            try:
                work.wait(timeout=timedelta(seconds=timeout_s))
            except RuntimeError as e:
                missing = wait_for_keys(store, {r: f"arrive/{i}/{r}" for r in range(world_size)}, time.monotonic())
                raise RanksMissing(f"{where} within {timeout_s:.0f}s", missing, arrived_all=not missing) from e
            synchronize(device)
            if it:
                elapsed.append(time.perf_counter() - t0)
        done.append((op, numel * 4, sum(elapsed) / len(elapsed)))
    return done


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def collect_results(store, rank: int, world_size: int, mine: list[tuple[str, int, float]], reporter: bool,
                    timeout_s: float) -> list[CollectiveResult]:
    """Share every rank's times through the store; the reporter assembles them."""
    store.set(f"times/{rank}", json.dumps(mine))
    if not reporter:
        return []
    missing = wait_for_keys(store, {r: f"times/{r}" for r in range(world_size)}, time.monotonic() + timeout_s)
    if missing:
        raise RanksMissing(f"reporting times within {timeout_s:.0f}s", missing)
    per_rank = {r: json.loads(store.get(f"times/{r}")) for r in range(world_size)}
    results = []
    for j, (op, size, _) in enumerate(mine):
        results.append(CollectiveResult(op, size, {r: per_rank[r][j][2] for r in range(world_size)}))
    return results


def format_collectives(results: list[CollectiveResult], backend: str, world_size: int, hosts: int) -> list[str]:
    """The collective table: per op and size, the ranks' time range, slowest rank, algorithm and bus bandwidth."""
    lines = [f"{'op':<11} {'size':>10}  {'time min..max (ms)':>20}  {'slowest':>7}  {'algbw GB/s':>10}  "
             f"{'busbw GB/s':>10}"]
    for r in results:
        times = r.times_s.values()
        lines.append(f"{r.op:<11} {_human(r.size_bytes):>10}  {1e3 * min(times):>9.2f}..{1e3 * max(times):<9.2f}  "
                     f"{'rank ' + str(r.slowest_rank):>7}  {r.algbw() / 1e9:>10.2f}  {r.busbw() / 1e9:>10.2f}")
    lines.insert(0, f"{backend}, {world_size} ranks on {hosts} host(s); per-rank times in --json")
    return lines


def compare_ranks(report: Report, payloads: dict[int, dict]) -> None:
    """Every rank should run the same stack: name the ranks whose versions differ from rank 0's."""
    s = "collectives"
    base = payloads[min(payloads)]["versions"]
    for key in ("torch", "torch_npu", "cann", "npu_driver", "nvidia_driver"):
        groups: dict[str, list[int]] = {}
        for r, p in payloads.items():
            groups.setdefault(str(p["versions"].get(key)), []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"{v} on ranks {_ranks(rs)}" for v, rs in groups.items())
            report.add("fail", s, f"{key} differs between ranks: {detail} (base {base.get(key)}); mismatched "
                                  "drivers or CANN across nodes are a common cause of HCCL init errors")


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def collective_check(report: Report, versions: dict, timeout_s: float, sizes: list[int], iters: int,
                     backend: str | None = None) -> int:
    """Check-in, then collectives on the job's backend; rank 0 reports the table. Returns 0 or 1."""
    import torch.distributed as dist

    from titan_npu.device import setup_device

    s = "collectives"
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = setup_device(backend or "auto")
    payload = {"host": socket.gethostname(), "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK", "0"),
               "device": device.type, "versions": versions}
    store = None
    try:
        store = open_side_channel(rank, world_size, timeout_s)
        payloads = check_in(store, rank, world_size, payload, timeout_s)
        hosts = len({p["host"] for p in payloads.values()})
        compare_ranks(report, payloads)
        dist.init_process_group(device.backend, store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        mine = run_collectives(store, rank, world_size, device, sizes, timeout_s, iters)
        results = collect_results(store, rank, world_size, mine, reporter=rank == 0, timeout_s=timeout_s)
        dist.destroy_process_group()
        report.facts["collectives"] = [r.as_dict() for r in results]
        if results:
            header, *table = format_collectives(results, device.backend, world_size, hosts)
            report.add("ok", s, header)
            for line in table:
                report.add("table", s, line)
        _finish(store, rank, world_size, timeout_s)
        return 0
    except RanksMissing as e:
        hint = "" if e.arrived_all else "; their hosts/logs show why (crashed, not launched, unreachable network)"
        report.add("fail", s, f"{e}{hint}")
        report.facts["missing_ranks"] = e.missing
        # A collective that timed out leaves the backend's threads waiting: leave without tearing the group down.
        report.facts["hung"] = dist.is_initialized()
        if store is not None and not report.facts["hung"]:
            _finish(store, rank, world_size, 1.0)
        return 1
    except Exception as e:  # the backend's own errors (HCCL/NCCL init, transport): one line, then leave
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        report.add("fail", s, f"rank {rank}: {device.backend} failed: {type(e).__name__}: {first}; check the "
                              "versions and variables above, and that every node reaches the others")
        report.facts["hung"] = dist.is_initialized()
        return 1


def _finish(store, rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 0 may host the store: it leaves only after the others are done with it."""
    store.set(f"done/{rank}", "1")
    if rank == 0:
        wait_for_keys(store, {r: f"done/{r}" for r in range(world_size)}, time.monotonic() + timeout_s)


# ---------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-npu doctor",
                                description="Check versions, devices, environment, disk and (under torchrun) "
                                            "collectives. Config keys can be overridden as --section.key value.")
    p.add_argument("--config", help="config file: adds the disk check and the variables the run will set")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for every rank at check-in and at each collective (default 60)")
    p.add_argument("--sizes", default="1,16,64", help="collective message sizes in MiB, comma separated")
    p.add_argument("--iters", type=int, default=3, help="timed repetitions of each collective (after a warm-up)")
    p.add_argument("--backend", help="process-group backend for the collective check (default: the device's)")
    p.add_argument("--no-collectives", action="store_true", help="skip the collective check under torchrun")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def _parse_sizes(text: str) -> list[int]:
    from titan_npu.errors import ConfigError

    try:
        sizes = [int(float(x) * 1024**2) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise ConfigError(f"--sizes {text!r} must be positive MiB values separated by commas, e.g. 1,16,64")
    return sizes


def main(argv: list[str]) -> int:
    """Entry of `titan-npu doctor`."""
    args, overrides = build_parser().parse_known_args(argv)
    sizes = _parse_sizes(args.sizes)
    cfg = None
    if args.config or overrides:
        from titan_npu.config.loader import load_config

        cfg = load_config(args.config, overrides)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    report = Report()
    versions = check_versions(report)
    devices = check_devices(report)
    env = check_environment(report, devices.get("type"), cfg)
    if cfg is not None:
        check_disk(report, cfg)
    report.facts.update(versions=versions, devices=devices, environment=env, host=socket.gethostname(), rank=rank,
                        world_size=world_size)
    code = 0
    if world_size > 1 and not args.no_collectives:
        code = collective_check(report, versions, args.timeout, sizes, args.iters, args.backend)
    elif world_size == 1:
        report.add("info", "collectives", "single process: run under torchrun to check collectives and bandwidth")
    failures = report.count("fail")
    report.add("fail" if failures else "ok", "summary",
               f"{failures} failure(s), {report.count('warn')} warning(s) on {socket.gethostname()} (rank {rank})")
    _print(report, args.json, rank, local_rank)
    code = 1 if failures or code else 0
    if report.facts.get("hung"):
        sys.stdout.flush()
        sys.stderr.flush()
        # A hung collective's backend threads would block a normal interpreter exit until the group's timeout.
        os._exit(code)
    return code


def _print(report: Report, as_json: bool, rank: int, local_rank: int) -> None:
    """Local rank 0 prints its node's checks; rank 0 the collectives; other ranks only their warnings/failures."""
    if as_json:
        if rank == 0 or local_rank == 0:
            print(json.dumps({"findings": [f.__dict__ for f in report.findings], "facts": report.facts},
                             indent=2, default=str))
        return
    if local_rank == 0 or rank == 0:
        header = f"titan-npu doctor on {socket.gethostname()}"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            header += f" (rank {rank} of {os.environ['WORLD_SIZE']})"
        print(header)
        print(report.format())
    else:
        text = report.format(levels=("warn", "fail"))
        if text:
            print("\n".join(f"[rank {rank}] {line}" for line in text.splitlines()))
    sys.stdout.flush()

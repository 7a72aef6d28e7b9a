"""The collective libraries' variables in effect (HCCL, NCCL, gloo, torchrun), what they do, and those known to bite."""

from __future__ import annotations

import os
import socket

from titan_npu.tools.doctor.report import Report

# What the collective libraries' variables do, for the environment listing.
ENV_MEANING: dict[str, str] = {
    "HCCL_CONNECT_TIMEOUT": "seconds HCCL waits for every rank to connect at init (default 120)",
    "HCCL_EXEC_TIMEOUT": "seconds HCCL's device-side tasks may wait for peers (default 1836); the collective "
                         "timeout itself is the process group's, comm.timeout_s, which must stay above it",
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
    "TASK_QUEUE_ENABLE": "torch_npu task-queue level (1 = training, torch_npu's default; 2 = pure inference only)",
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
    for level, message in thread_count_problems(env) + whole_number_problems(env):
        report.add(level, s, message)
    nodes = _node_count()
    connect = env.get("HCCL_CONNECT_TIMEOUT")
    if device_type == "npu" and nodes > 1 and connect and connect.isdigit() and int(connect) < 300:
        report.add("warn", s, f"HCCL_CONNECT_TIMEOUT={connect}s on a {nodes}-node job: nodes that start a few "
                              "minutes apart fail HCCL init; set it to 1800 (the [comm] init_timeout_s default)")
    exec_timeout = env.get("HCCL_EXEC_TIMEOUT")
    if exec_timeout and exec_timeout.isdigit() and 0 < int(exec_timeout) < 600:
        report.add("warn", s, f"HCCL_EXEC_TIMEOUT={exec_timeout}s: ranks waiting on a slow checkpoint save or data "
                              "read hit it (the 'timeout at step N' crash); 1800 leaves room")
    if device_type == "npu":
        from titan_npu.config.schema import CommConfig
        from titan_npu.device.env import exec_timeout_problem

        problem = exec_timeout_problem((cfg.comm if cfg is not None else CommConfig()).timeout_s)
        if problem:
            report.add("warn", s, problem)
        if os.environ.get("TASK_QUEUE_ENABLE", "").strip() == "2":
            report.add("warn", s, "TASK_QUEUE_ENABLE=2 is torch_npu's pure-inference level (torch_npu.npu."
                                  "set_task_queue_enable); unset it for training (the run sets training.npu_task_queue,"
                                  " 1)")
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


# Variables whose value the libraries read as a whole number (torch_npu / HCCL / NCCL); another value is not used as
# meant, so the doctor says so rather than skipping its own checks of it in silence.
WHOLE_NUMBER_VARS = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "TASK_QUEUE_ENABLE",
                     "STREAMS_PER_DEVICE", "NCCL_BUFFSIZE")


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_count_problems(env: dict[str, str]) -> list[tuple[str, str]]:
    """(level, message) for an OMP_NUM_THREADS that OpenMP cannot parse: OpenMP reads a comma-separated list of
    positive whole numbers (the first is the thread count); anything else it ignores with 'libgomp: Invalid value
    for environment variable OMP_NUM_THREADS', and torch then runs its default of one thread per core."""
    value = env.get("OMP_NUM_THREADS")
    if value is None:
        return []
    items = [item.strip() for item in value.split(",")]
    if all(item.isdigit() and int(item) > 0 for item in items):
        return []
    cores = available_cores()
    return [("warn", f"OMP_NUM_THREADS={value!r} is unparsable (OpenMP wants a positive whole number, such as "
                     f"{cores}): OpenMP ignores it and torch runs its default, one thread per available core "
                     f"({cores} here); set it to a positive number or unset it")]


def whole_number_problems(env: dict[str, str]) -> list[tuple[str, str]]:
    """(level, message) for each of WHOLE_NUMBER_VARS set to something other than a whole number."""
    return [("warn", f"{name}={env[name]!r} is not a whole number, which the library reads it as; it is not used "
                     f"as meant (ignored or refused at start-up): set a whole number or unset it")
            for name in WHOLE_NUMBER_VARS if name in env and not env[name].strip().isdigit()]

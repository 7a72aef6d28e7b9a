"""Start-up hints for settings measured to be slow on the device in use (see docs/performance.md)."""

from __future__ import annotations

from titan_npu.config.schema import JobConfig


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 / AMX, Arm BF16); None when unknown."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    if not flags:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def speed_hints(cfg: JobConfig, device_type: str) -> list[str]:
    """One line per setting that is known to cost speed on this device type, with the faster choice."""
    hints = []
    if device_type != "cpu":
        return hints
    if cfg.training.dtype == "bf16" and cpu_has_native_bf16() is False:
        hints.append("training.dtype=bf16 on a CPU without bf16 instructions (AVX512-BF16 / AMX): its matmuls are "
                     "emulated, several times slower than fp32; training.dtype=fp32 trains faster here")
    if cfg.data.num_workers > 0:
        # A batch is a read of already tokenised windows (well under a millisecond in-process); worker processes
        # only add inter-process copies and compete with the training threads for the same cores.
        hints.append(f"data.num_workers={cfg.data.num_workers} on cpu: loader processes compete with the training "
                     "threads for the same cores; data.num_workers=0 is faster here")
    return hints

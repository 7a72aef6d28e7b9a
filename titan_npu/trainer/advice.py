"""Start-up hints for settings measured to be slow on the device in use (see docs/performance.md)."""

from __future__ import annotations

from titan_npu.config.schema import JobConfig
from titan_npu.ops.cpu import BF16_MATMUL_ENV, cpu_has_native_bf16, widen_bf16


def speed_hints(cfg: JobConfig, device_type: str) -> list[str]:
    """One line per setting that is known to cost speed on this device type, with the faster choice."""
    hints = []
    if device_type != "cpu":
        return hints
    if cfg.training.dtype == "bf16" and cpu_has_native_bf16() is False:
        if widen_bf16():
            hints.append("training.dtype=bf16 on a CPU without bf16 instructions (AVX512-BF16 / AMX): matmuls and "
                         "attention run widened to fp32 with bf16 rounding, which adds conversions fp32 training does "
                         "not pay; training.dtype=fp32 trains faster here")
        else:
            hints.append(f"training.dtype=bf16 with {BF16_MATMUL_ENV}=native on a CPU without bf16 instructions: its "
                         f"matmuls are emulated, several times slower; unset {BF16_MATMUL_ENV} (or use fp32)")
    if cfg.activation_checkpoint.offload:
        hints.append("activation_checkpoint.offload on cpu: the host is the device here, so the saved activations "
                     "are only copied within the same memory (no memory saved, slower); it helps on npu/cuda, set "
                     "activation_checkpoint.offload = false for cpu runs")
    if cfg.data.num_workers > 0:
        # A batch is a read of already tokenised windows (well under a millisecond in-process); worker processes
        # only add inter-process copies and compete with the training threads for the same cores.
        hints.append(f"data.num_workers={cfg.data.num_workers} on cpu: loader processes compete with the training "
                     "threads for the same cores; data.num_workers=0 is faster here")
    return hints

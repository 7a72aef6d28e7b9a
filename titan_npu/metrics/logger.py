"""Where step metrics go: the console line of DESIGN.md, <log_dir>/metrics.jsonl, and TensorBoard when enabled."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("titan_npu")


def format_step_line(m: dict[str, Any]) -> str:
    """The console line: `[Step 100] loss=7.1203, lr=2.70e-04, grad_norm=1.234, throughput=980 tokens/s, ...`."""
    parts = [f"loss={m['loss']:.4f}", f"lr={m['lr']:.2e}", f"grad_norm={m['grad_norm']:.3f}"]
    parts.append(f"throughput={m['tokens_per_s']:,.0f} tokens/s")
    parts.append(f"mfu={100 * m['mfu']:.1f}%")
    parts.append(f"mem={m['mem_used_gb']:.1f}GB/{m['mem_total_gb']:.1f}GB")
    parts.append(f"step_time={m['step_time_s']:.2f}s")
    line = f"[Step {m['step']}] " + ", ".join(parts)
    flags = m.get("flags")
    if flags:
        line += "  " + " ".join(f"[{f}]" for f in flags)
    return line


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v


class MetricsLogger:
    """Writes each logged step to every sink; only rank 0 writes anything."""

    def __init__(self, log_dir: str | os.PathLike, rank: int = 0, tensorboard: bool = False) -> None:
        self.enabled = rank == 0
        self.log_dir = Path(log_dir)
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed (pip install tensorboard); metrics go to metrics.jsonl only")

    def log(self, metrics: dict[str, Any]) -> None:
        """Print the step line and append one JSON object."""
        if not self.enabled:
            return
        log.info(format_step_line(metrics))
        self._jsonl.write(json.dumps({k: _json_value(v) for k, v in metrics.items()}) + "\n")
        if self._tb is not None:
            step = metrics["step"]
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

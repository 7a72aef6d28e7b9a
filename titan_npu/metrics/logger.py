"""Where step metrics go: the console line of DESIGN.md, <log_dir>/metrics.jsonl, TensorBoard and W&B when enabled."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from titan_npu.errors import ConfigError
from titan_npu.metrics.mixture import format_mix
from titan_npu.metrics.progress import format_duration

log = logging.getLogger("titan_npu")


def format_step_line(m: dict[str, Any]) -> str:
    """The console line: `[Step 100] loss=7.1203, lr=2.70e-04, grad_norm=1.234, throughput=980 tokens/s, ...`."""
    parts = [f"loss={m['loss']:.4f}", f"lr={m['lr']:.2e}", f"grad_norm={m['grad_norm']:.3f}"]
    if "aux_loss" in m:  # a MoE model: its load-balancing loss and how uneven the experts' load is
        parts.append(f"aux_loss={m['aux_loss']:.4f}, expert_load={m['expert_load_max_mean']:.2f}x")
    parts.append(f"throughput={m['tokens_per_s']:,.0f} tokens/s")
    if "loss_tokens" in m:  # the step's valid labels (every token in pretraining, the unmasked ones in fine-tuning)
        parts.append(f"loss_tokens={m['loss_tokens']:,}")
    parts.append(f"mfu={100 * m['mfu']:.1f}%")
    parts.append(f"mem={m['mem_used_gb']:.1f}GB/{m['mem_total_gb']:.1f}GB")
    parts.append(f"step_time={m['step_time_s']:.2f}s")
    mix = format_mix(m)  # a data mixture: each source's share of the tokens so far
    if mix:
        parts.append(mix)
    if "replicas" in m:  # fault tolerance: the replica groups that took part in the step
        parts.append(f"replicas={m['replicas']}")
    if m.get("eta_s") is not None:
        parts.append(f"eta={format_duration(m['eta_s'])}")
    line = f"[Step {m['step']}] " + ", ".join(parts)
    flags = m.get("flags")
    if flags:
        line += "  " + " ".join(f"[{f}]" for f in flags)
    return line


def format_validation_line(m: dict[str, Any]) -> str:
    """`[Step 500] val_loss=2.3456, val_ppl=10.45 (10 batches, 20,480 tokens, 1.2s)`; a mixture adds each source's
    `web=2.1012`."""
    per_source = [f"{k[len('val_loss/'):]}={v:.4f}" for k, v in m.items() if k.startswith("val_loss/")]
    mix = f" [{', '.join(per_source)}]" if per_source else ""
    return (f"[Step {m['step']}] val_loss={m['val_loss']:.4f}, val_ppl={m['val_ppl']:.2f}{mix} "
            f"({m['val_batches']} batches, {m['val_tokens']:,} tokens, {m['val_time_s']:.1f}s)")


def format_eval_line(record: dict[str, Any]) -> str:
    """`[Eval 200] titan_mc acc=0.3400 acc_norm=0.3000 | titan_cloze acc=0.0500 perplexity=812.1 (12.3s)`."""
    tasks: dict[str, list[str]] = {}
    for key, value in record.items():
        if key.startswith("eval/"):
            _, task, metric = key.split("/", 2)
            tasks.setdefault(task, []).append(f"{metric}={value:.4g}")
    shown = " | ".join(f"{task} {' '.join(parts)}" for task, parts in tasks.items())
    return f"[Eval {record['step']}] {shown} ({record['eval_time_s']:.1f}s, not counted in throughput)"


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable ("nan", "inf"); the report reads them back
    return v


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def import_wandb():
    """The wandb module, or a ConfigError that says how to install it or turn it off."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("metrics.wandb=true but the 'wandb' package is not installed; pip install wandb "
                          "(or titan-npu[wandb]), or set metrics.wandb=false") from None
    return wandb


class MetricsLogger:
    """Writes each logged step to every sink; only rank 0 writes anything.

    metrics.jsonl holds one JSON object per line: training records (key "loss") at log steps and validation
    records (key "val_loss"); docs/metrics.md lists every key.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        rank: int = 0,
        tensorboard: bool = False,
        wandb: bool = False,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = rank == 0
        self.log_dir = Path(log_dir)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        # W&B first: a missing package is the user's to fix and must stop the run before anything is written.
        wandb_module = import_wandb() if wandb else None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed (pip install tensorboard); metrics go to metrics.jsonl only")
        if wandb_module is not None:
            # Project and entity come from WANDB_PROJECT / WANDB_ENTITY when set; WANDB_MODE=offline works too.
            self._wandb = wandb_module.init(
                project=os.environ.get("WANDB_PROJECT", "titan-npu"),
                name=os.environ.get("WANDB_NAME", self.log_dir.resolve().name),
                dir=str(self.log_dir),
                config=run_config or {},
            )

    def _write(self, metrics: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps({k: _json_value(v) for k, v in metrics.items()}) + "\n")
        step = metrics["step"]
        scalars = _scalars(metrics)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log(self, metrics: dict[str, Any]) -> None:
        """Print the step line and write the record to every sink."""
        if not self.enabled:
            return
        log.info(format_step_line(metrics))
        self._write(metrics)

    def log_validation(self, metrics: dict[str, Any]) -> None:
        """Print the validation line and write the record (step, val_loss, val_ppl, ...) to every sink."""
        if not self.enabled:
            return
        log.info(format_validation_line(metrics))
        self._write(metrics)

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """Print the evaluation line and write the record (step, eval_time_s, eval/<task>/<metric>) to every sink."""
        if not self.enabled:
            return
        log.info(format_eval_line(metrics))
        self._write(metrics)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

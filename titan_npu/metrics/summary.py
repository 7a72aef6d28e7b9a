"""The figures a run's report states, from its metrics records: tokens seen, final and best loss, median
throughput and MFU (the first logged window left out), peak memory, flags, expert load."""

from __future__ import annotations

import math
import statistics
from typing import Any

from titan_npu.metrics.run_metrics import RunMetrics


def finite_points(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record whose `key` is a finite number."""
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((r["step"], float(v)))
    return out


def expert_load(train: list[dict[str, Any]]) -> tuple[list[tuple[int, float]], list[list[tuple[int, float]]]]:
    """(step, expert_load_max_mean) and, per MoE layer, (step, its max / mean tokens per expert) from the records
    that have them (a MoE model's run); both empty for a dense model."""
    per_layer: dict[int, list[tuple[int, float]]] = {}
    for r in train:
        values = r.get("expert_load_per_layer")
        if not isinstance(values, list):
            continue
        for i, v in enumerate(values):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                per_layer.setdefault(i, []).append((r["step"], float(v)))
    return finite_points(train, "expert_load_max_mean"), [per_layer[i] for i in sorted(per_layer)]


def steady_records(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training records without the first logged window (start-up, compilation), unless it is all there is."""
    return train[1:] if len(train) > 1 else train


def human(n: float) -> str:
    """1234567 -> "1.23M": a count in B (billions), M or K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def summary(run: RunMetrics) -> dict[str, Any]:
    """The figures of report.md: tokens seen, final/best loss, median throughput and MFU, peak memory, flags."""
    s: dict[str, Any] = {}
    train, val = run.train, run.val
    if train:
        last = train[-1]
        s["last_step"] = last["step"]
        s["tokens_seen"] = last.get("tokens_seen")
        s["final_loss"] = (last["step"], last["loss"])
        losses = finite_points(train, "loss")
        s["best_loss"] = min(losses, key=lambda x: x[1]) if losses else None
        steady = steady_records(train)
        for key in ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "step_time_s",
                    "data_time_s"):
            values = [v for _, v in finite_points(steady, key)]
            s[f"median_{key}"] = statistics.median(values) if values else None
        peaks = [v for _, v in finite_points(train, "mem_peak_gb") or finite_points(train, "mem_used_gb")]
        s["peak_mem_gb"] = max(peaks) if peaks else None
        totals = [v for _, v in finite_points(train, "mem_total_gb")]
        s["mem_total_gb"] = totals[-1] if totals else None
        s["flags"] = [(r["step"], f) for r in train for f in (r.get("flags") or [])]
        load = finite_points(train, "expert_load_max_mean")
        s["expert_load"] = (statistics.median(v for _, v in load), load[-1]) if load else None
    if val:
        s["final_val"] = (val[-1]["step"], val[-1]["val_loss"], val[-1].get("val_ppl"))
        vl = finite_points(val, "val_loss")
        best = min(vl, key=lambda x: x[1]) if vl else None
        s["best_val"] = (best[0], best[1], math.exp(best[1]) if best[1] < 700 else math.inf) if best else None
    return s

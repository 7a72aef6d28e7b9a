"""`titan-npu report LOG_DIR`: plots (report.png) and a markdown summary (report.md) of a run from its log dir.

The same function runs on rank 0 at the end of every training run. It reads only files: metrics.jsonl, config.toml
and run_info.json (written by the trainer at start-up), and lists the checkpoint directory if it exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_npu.atomic import atomic_path, atomic_write_json, atomic_write_text
from titan_npu.errors import DataError, TitanError

log = logging.getLogger("titan_npu")

RUN_INFO = "run_info.json"
METRICS = "metrics.jsonl"
REPORT_HEADING = "# Run report: "  # report.md's first line: how a report this module wrote is recognised


# ----------------------------------------------------------------------------------------------------------- files
def write_run_info(log_dir: str | os.PathLike, info: dict[str, Any]) -> Path:
    """Save what the report needs to know about the run that metrics.jsonl does not say (model, layout, device)."""
    path = Path(log_dir) / RUN_INFO
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(info, written_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    atomic_write_json(path, payload, indent=2, default=str)
    return path


def run_info(model_args: Any, layout: str, device: Any, world_size: int, tokens_per_step: int,
             flops_per_token: float, peak_flops: float, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The run_info.json fields from the trainer's objects (the model's args, DeviceInfo)."""
    a = model_args
    return {
        "params": a.num_params(),
        "non_embedding_params": a.num_params(exclude_embedding=True),
        "shape": f"dim {a.dim}, {a.n_layers} layers, {a.n_heads}/{a.n_kv_heads} heads, ffn {a.ffn_dim}, "
                 f"vocab {a.vocab_size}",
        "layout": layout,
        "device": f"{world_size} x {device.type} ({device.name}, backend {device.backend})",
        "world_size": world_size,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "peak_tflops": peak_flops / 1e12,
        "checkpoint_dir": str(Path(checkpoint_dir).resolve()),
    }


def _number(v: Any) -> Any:
    """metrics.jsonl writes NaN/inf as strings; turn them back into floats."""
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(v)
    return v


@dataclass
class RunMetrics:
    """The records of metrics.jsonl, split into training and validation records, each sorted by step."""

    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0


def _append(records: list[dict[str, Any]], rec: dict[str, Any]) -> None:
    # A run resumed from an older checkpoint (or restarted in the same dir) logs steps again: the newer wins.
    while records and records[-1]["step"] >= rec["step"]:
        records.pop()
    records.append(rec)


def read_metrics(log_dir: str | os.PathLike) -> RunMetrics:
    """Parse <log_dir>/metrics.jsonl; unreadable lines (a crash mid-write) are counted and skipped."""
    path = Path(log_dir) / METRICS
    if not path.is_file():
        where = Path(log_dir)
        what = "does not exist" if not where.exists() else f"has no {METRICS}"
        raise DataError(f"{where} {what}; give the metrics.log_dir of a run (the directory holding {METRICS})")
    run = RunMetrics()
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                run.skipped_lines += 1
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                run.skipped_lines += 1
                continue
            rec = {k: _number(v) for k, v in rec.items()}
            if "val_loss" in rec:
                _append(run.val, rec)
            elif "loss" in rec:
                _append(run.train, rec)
            else:
                run.skipped_lines += 1
    if not run.train and not run.val:
        raise DataError(f"{path} holds no step records; the run logged nothing yet (metrics.log_interval steps "
                        f"must pass before the first line after step 1)")
    return run


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError):
        return {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------------------------------- summary
def _finite(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
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
    return _finite(train, "expert_load_max_mean"), [per_layer[i] for i in sorted(per_layer)]


def steady_records(train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training records without the first logged window (start-up, compilation), unless it is all there is."""
    return train[1:] if len(train) > 1 else train


def _human(n: float) -> str:
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
        losses = _finite(train, "loss")
        s["best_loss"] = min(losses, key=lambda x: x[1]) if losses else None
        steady = steady_records(train)
        for key in ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "step_time_s",
                    "data_time_s"):
            values = [v for _, v in _finite(steady, key)]
            s[f"median_{key}"] = statistics.median(values) if values else None
        peaks = [v for _, v in _finite(train, "mem_peak_gb") or _finite(train, "mem_used_gb")]
        s["peak_mem_gb"] = max(peaks) if peaks else None
        totals = [v for _, v in _finite(train, "mem_total_gb")]
        s["mem_total_gb"] = totals[-1] if totals else None
        s["flags"] = [(r["step"], f) for r in train for f in (r.get("flags") or [])]
        load = _finite(train, "expert_load_max_mean")
        s["expert_load"] = (statistics.median(v for _, v in load), load[-1]) if load else None
    if val:
        s["final_val"] = (val[-1]["step"], val[-1]["val_loss"], val[-1].get("val_ppl"))
        vl = _finite(val, "val_loss")
        best = min(vl, key=lambda x: x[1]) if vl else None
        s["best_val"] = (best[0], best[1], math.exp(best[1]) if best[1] < 700 else math.inf) if best else None
    return s


def _fmt(v: Any, spec: str = ".4f", missing: str = "n/a") -> str:
    if v is None:
        return missing
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def list_checkpoints(ckpt_dir: Path | None) -> list[str]:
    """One line per complete checkpoint in the checkpoint dir (step-N, size), oldest first."""
    if ckpt_dir is None or not ckpt_dir.is_dir():
        return []
    from titan_npu.checkpoint import storage

    lines = []
    for ref in storage.list_checkpoints(ckpt_dir):
        size = sum(f.stat().st_size for f in ref.path.rglob("*") if f.is_file())
        lines.append(f"{ref.path.name} (step {ref.step}, {size / 1024**2:,.1f} MiB)")
    return lines


def _checkpoint_dir(log_dir: Path, info: dict[str, Any], config: dict[str, Any]) -> Path | None:
    candidates = []
    if info.get("checkpoint_dir"):
        candidates.append(Path(info["checkpoint_dir"]))
    rel = config.get("checkpoint", {}).get("dir")
    if rel:
        candidates += [Path(rel), log_dir.parent / rel, log_dir / rel]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0] if candidates else None


def render_markdown(log_dir: Path, run: RunMetrics, config: dict[str, Any], info: dict[str, Any],
                    png_name: str | None) -> str:
    """report.md's text."""
    s = summary(run)
    m, t = config.get("model", {}), config.get("training", {})
    opt, sched, data = config.get("optimizer", {}), config.get("lr_scheduler", {}), config.get("data", {})
    rows: list[tuple[str, str]] = []
    model = f"{m.get('name', '?')} {m.get('flavor', '')}".strip()
    if info.get("params"):
        model += f", {_human(info['params'])} params ({_human(info.get('non_embedding_params', 0))} non-embedding)"
    if info.get("shape"):
        model += f", {info['shape']}"
    rows.append(("model", model))
    if t:
        rows.append(("training", f"batch_size={t.get('batch_size')} x seq_len={t.get('seq_len')} x "
                                 f"grad_accum={t.get('gradient_accumulation_steps')}, max_steps={t.get('max_steps')}, "
                                 f"dtype={t.get('dtype')}"))
    if opt:
        rows.append(("optimizer", f"{opt.get('name')} lr={opt.get('lr')} weight_decay={opt.get('weight_decay')}, "
                                  f"{sched.get('decay_type', '?')} schedule, warmup {sched.get('warmup_steps', '?')}"))
    if data:
        rows.append(("data", f"{data.get('path') or 'built-in corpus'} (tokenizer {data.get('tokenizer')})"))
    if info.get("layout"):
        rows.append(("layout", info["layout"]))
    if info.get("device"):
        rows.append(("device", f"{info['device']}, peak {_fmt(info.get('peak_tflops'), '.3g')} TFLOP/s per device"))
    if info.get("tokens_per_step"):
        rows.append(("tokens per step", f"{info['tokens_per_step']:,} (global)"))
    if "last_step" in s:
        tokens = s.get("tokens_seen")
        rows.append(("steps logged", f"up to step {s['last_step']}"))
        rows.append(("tokens seen", f"{tokens:,} ({_human(tokens)})" if tokens else "n/a"))
        step, loss = s["final_loss"]
        rows.append(("final loss", f"{_fmt(loss)} (step {step})"))
        if s["best_loss"]:
            rows.append(("best loss", f"{_fmt(s['best_loss'][1])} (step {s['best_loss'][0]})"))
    if s.get("final_val"):
        step, loss, ppl = s["final_val"]
        rows.append(("final val loss", f"{_fmt(loss)}, perplexity {_fmt(ppl, '.2f')} (step {step})"))
        if s["best_val"]:
            bs, bl, bp = s["best_val"]
            rows.append(("best val loss", f"{_fmt(bl)}, perplexity {_fmt(bp, '.2f')} (step {bs})"))
    if "last_step" in s:
        rows.append(("median throughput", f"{_fmt(s['median_tokens_per_s'], ',.0f')} tokens/s global, "
                                          f"{_fmt(s['median_tokens_per_s_per_device'], ',.0f')} per device "
                                          f"(first logged window left out)"))
        mfu = s["median_mfu"]
        rows.append(("median MFU", f"{_fmt(None if mfu is None else 100 * mfu, '.1f')}% "
                                   f"({_fmt(s['median_tflops_per_device'], '.3g')} TFLOP/s per device)"))
        rows.append(("median step time", f"{_fmt(s['median_step_time_s'], '.3f')} s "
                                         f"(data loading {_fmt(s['median_data_time_s'], '.3f')} s)"))
        rows.append(("peak memory", f"{_fmt(s['peak_mem_gb'], '.2f')} GB of {_fmt(s['mem_total_gb'], '.1f')} GB"))
        if s["expert_load"]:
            median, (step, last) = s["expert_load"]
            rows.append(("expert load", f"max / mean tokens per expert, mean over the MoE layers: median "
                                        f"{median:.2f}, {last:.2f} at step {step} (1.00 = even)"))
        flags = s["flags"]
        rows.append(("flags", "none" if not flags else f"{len(flags)}: " + "; ".join(
            f"step {st}: {f}" for st, f in flags[:5]) + (" ..." if len(flags) > 5 else "")))

    ckpt_dir = _checkpoint_dir(log_dir, info, config)
    lines = [f"{REPORT_HEADING}{log_dir.resolve().name}", ""]
    if png_name:
        lines += [f"![loss, learning rate, throughput and memory against step]({png_name})", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
    lines.append(f"## Checkpoints ({ckpt_dir if ckpt_dir else 'no checkpoint dir configured'})")
    lines.append("")
    entries = list_checkpoints(ckpt_dir)
    lines += [f"- {e}" for e in entries] if entries else ["none written"]
    lines.append("")
    notes = ["Source: metrics.jsonl, config.toml and run_info.json in this directory. Throughput and MFU are medians "
             "over the logged windows after the first; docs/metrics.md explains every figure."]
    if run.skipped_lines:
        notes.append(f"{run.skipped_lines} unreadable line(s) of metrics.jsonl were skipped.")
    lines += notes + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- plots
def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise TitanError("the report's plots need matplotlib, which is not installed; pip install matplotlib "
                         "(or titan-npu[plot]); report.md is written without it") from None
    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    return plt


def build_figure(run: RunMetrics, title: str = ""):
    """A 2x2 matplotlib figure: loss (train, validation, flagged steps), learning rate, throughput/MFU, memory; and
    for a MoE model's run (metrics with expert_load_max_mean) a full-width expert-load panel below them."""
    plt = _require_matplotlib()
    train, val = run.train, run.val
    load_mean, load_layers = expert_load(train)
    if load_mean or load_layers:
        fig = plt.figure(figsize=(12, 11.25), dpi=110)
        grid = fig.add_gridspec(3, 2)
        (ax_loss, ax_lr), (ax_tp, ax_mem) = [[fig.add_subplot(grid[row, col]) for col in (0, 1)] for row in (0, 1)]
        _plot_expert_load(fig.add_subplot(grid[2, :]), load_mean, load_layers)
    else:
        fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=110)
        (ax_loss, ax_lr), (ax_tp, ax_mem) = axes

    loss = _finite(train, "loss")
    if loss:
        ax_loss.plot(*zip(*loss), label="train", color="tab:blue", linewidth=1.4)
    vloss = _finite(val, "val_loss")
    if vloss:
        ax_loss.plot(*zip(*vloss), label="validation", color="tab:orange", marker="o", markersize=4, linewidth=1.4)
    flagged = [(r["step"], r["loss"]) for r in train if r.get("flags") and isinstance(r.get("loss"), float)
               and math.isfinite(r["loss"])]
    if flagged:
        ax_loss.scatter(*zip(*flagged), color="tab:red", marker="x", s=40, zorder=3, label="flagged step")
    ax_loss.set_title("loss")
    ax_loss.set_ylabel("cross entropy (nats/token)")

    lr = _finite(train, "lr")
    if lr:
        ax_lr.plot(*zip(*lr), color="tab:green", linewidth=1.4)
    ax_lr.set_title("learning rate")
    ax_lr.set_ylabel("lr")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    steady = steady_records(train)
    tps = _finite(steady, "tokens_per_s")
    if tps:
        ax_tp.plot(*zip(*tps), color="tab:purple", linewidth=1.4, label="tokens/s (global)")
    ax_tp.set_title("throughput (first logged window left out)")
    ax_tp.set_ylabel("tokens/s, all devices")
    # MFU is tokens/s times a constant (FLOPs per token / peak / devices): a second scale on the same line.
    ratios = [r["mfu"] / r["tokens_per_s"] for r in steady if isinstance(r.get("mfu"), float)
              and isinstance(r.get("tokens_per_s"), float) and r["tokens_per_s"] > 0 and r["mfu"] > 0]
    if ratios:
        k = 100 * statistics.median(ratios)
        ax_mfu = ax_tp.secondary_yaxis("right", functions=(lambda x: x * k, lambda y: y / k))
        ax_mfu.set_ylabel("MFU (%)")
    ax_tp.set_ylim(bottom=0)

    used, peak = _finite(train, "mem_used_gb"), _finite(train, "mem_peak_gb")
    if used:
        ax_mem.plot(*zip(*used), color="tab:cyan", linewidth=1.4, label="used")
    if peak:
        ax_mem.plot(*zip(*peak), color="tab:brown", linewidth=1.2, linestyle="--", label="peak")
    totals = _finite(train, "mem_total_gb")
    total_text = f" (device total {totals[-1][1]:.1f} GB)" if totals else ""
    ax_mem.set_title("memory" + total_text)
    ax_mem.set_ylabel("GB")
    ax_mem.set_ylim(0, 1.15 * max([v for _, v in used + peak] or [1.0]))

    for ax in (ax_loss, ax_lr, ax_tp, ax_mem):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    for ax in (ax_loss, ax_mem):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# Per-layer lines get a legend entry each up to this many layers; more share one entry.
LOAD_LEGEND_LAYERS = 8


def _plot_expert_load(ax, mean: list[tuple[int, float]], layers: list[list[tuple[int, float]]]) -> None:
    """The expert-load panel: each MoE layer's max / mean tokens per expert (thin), their mean (bold), 1.0 = even."""
    for i, points in enumerate(layers):
        label = f"layer {i}" if len(layers) <= LOAD_LEGEND_LAYERS else ("per layer" if i == 0 else None)
        ax.plot(*zip(*points), linewidth=0.8, alpha=0.6, label=label)
    if mean:
        ax.plot(*zip(*mean), color="black", linewidth=1.8, label="mean over layers")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1.0, label="even")
    ax.set_title("expert load (MoE layers)")
    ax.set_ylabel("max / mean tokens per expert")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=min(5, len(layers) + 2))


def plot_report(run: RunMetrics, out_png: Path, title: str = "") -> Path:
    """Save build_figure's plots as a PNG (atomically)."""
    plt = _require_matplotlib()
    fig = build_figure(run, title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out_png) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return out_png


# ---------------------------------------------------------------------------------------------------------- entry


def check_report_dir(out: Path) -> None:
    """DataError when writing report.md / report.png into `out` would replace or add to what is not ours: a file
    named like the folder, a report.md written by someone else, or a checkpoint's files."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; name a folder for report.md and report.png")
    for folder in (out.resolve(), *out.resolve().parents):
        if (folder / ".metadata").is_file() or (folder / "checkpoint.json").is_file():
            raise DataError(f"--out {out} lies inside the checkpoint {folder}; write the report elsewhere")
    md = out / "report.md"
    if md.is_file():
        with open(md, encoding="utf-8", errors="replace") as f:
            ours = f.readline().startswith(REPORT_HEADING)
        if not ours:
            raise DataError(f"--out {out} holds a report.md that titan-npu report did not write; move it away or "
                            "choose another --out")


def write_report(log_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 plots: bool = True) -> list[Path]:
    """Write report.png (when matplotlib is there and `plots`) and report.md; returns the files written."""
    log_dir = Path(log_dir)
    out = Path(out_dir) if out_dir is not None else log_dir
    run = read_metrics(log_dir)
    config = _read_toml(log_dir / "config.toml")
    info = _read_json(log_dir / RUN_INFO)
    check_report_dir(out)
    if plots:
        _require_matplotlib()  # before anything is created
    out.mkdir(parents=True, exist_ok=True)
    written = []
    png_name = None
    if plots:
        m = config.get("model", {})
        title = f"{log_dir.resolve().name}: {m.get('name', '')} {m.get('flavor', '')}".strip()
        written.append(plot_report(run, out / "report.png", title=title))
        png_name = "report.png"
    md = render_markdown(log_dir, run, config, info, png_name)
    md_path = out / "report.md"
    atomic_write_text(md_path, md)
    written.append(md_path)
    return written


def final_report(log_dir: str | os.PathLike) -> list[Path]:
    """The end-of-run report on rank 0: never fails the run (no matplotlib -> report.md only, with a warning)."""
    import importlib.util

    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:
        log.warning("matplotlib is not installed (pip install matplotlib): report.md is written without report.png")
    try:
        return write_report(log_dir, plots=plots)
    except (TitanError, OSError) as e:
        log.warning("no report written: %s", e)
        return []


def main(argv: list[str]) -> int:
    """`titan-npu report LOG_DIR [--out DIR] [--no-plots]`."""
    p = argparse.ArgumentParser(prog="titan-npu report", description="Plot and summarise a run from its log dir.")
    p.add_argument("log_dir", help="the run's metrics.log_dir (holds metrics.jsonl and config.toml)")
    p.add_argument("--out", help="where to write report.png and report.md (default: LOG_DIR)")
    p.add_argument("--no-plots", action="store_true", help="write report.md only (no matplotlib needed)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    args = p.parse_args(argv)
    for path in write_report(args.log_dir, args.out, plots=not args.no_plots):
        print(path)
    return 0

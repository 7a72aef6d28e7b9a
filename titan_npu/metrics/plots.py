"""report.png: loss, learning rate, throughput / MFU and memory against step (and expert load for a MoE run),
drawn with matplotlib when it is installed."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from titan_npu.atomic import atomic_path
from titan_npu.errors import TitanError
from titan_npu.metrics.run_metrics import RunMetrics
from titan_npu.metrics.summary import expert_load, finite_points, steady_records


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend; TitanError with the install line when matplotlib is missing."""
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
    plt = require_matplotlib()
    train, val = run.train, run.val
    load_mean, load_layers = expert_load(train)
    mix = source_tokens(train)
    extra: list[str] = [panel for panel, wanted in (("load", load_mean or load_layers), ("mix", mix)) if wanted]
    extra += [f"eval:{task}" for task in eval_tasks(run.evals)]
    if extra:
        fig = plt.figure(figsize=(12, 7.5 + 3.75 * len(extra)), dpi=110)
        grid = fig.add_gridspec(2 + len(extra), 2)
        (ax_loss, ax_lr), (ax_tp, ax_mem) = [[fig.add_subplot(grid[row, col]) for col in (0, 1)] for row in (0, 1)]
        for row, panel in enumerate(extra, 2):
            if panel == "load":
                _plot_expert_load(fig.add_subplot(grid[row, :]), load_mean, load_layers)
            elif panel.startswith("eval:"):
                _plot_eval(fig.add_subplot(grid[row, :]), run.evals, panel[len("eval:"):])
            else:
                _plot_mixture(fig.add_subplot(grid[row, :]), mix)
    else:
        fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=110)
        (ax_loss, ax_lr), (ax_tp, ax_mem) = axes

    loss = finite_points(train, "loss")
    if loss:
        ax_loss.plot(*zip(*loss), label="train", color="tab:blue", linewidth=1.4)
    vloss = finite_points(val, "val_loss")
    if vloss:
        ax_loss.plot(*zip(*vloss), label="validation", color="tab:orange", marker="o", markersize=4, linewidth=1.4)
    for key in sorted({k for r in val for k in r if k.startswith("val_loss/")}):  # a mixture: each source's
        points = finite_points(val, key)
        if points:
            ax_loss.plot(*zip(*points), label=f"validation {key[len('val_loss/'):]}", marker=".", linestyle="--",
                         linewidth=1.0)
    flagged = [(r["step"], r["loss"]) for r in train if r.get("flags") and isinstance(r.get("loss"), float)
               and math.isfinite(r["loss"])]
    if flagged:
        ax_loss.scatter(*zip(*flagged), color="tab:red", marker="x", s=40, zorder=3, label="flagged step")
    ax_loss.set_title("loss")
    ax_loss.set_ylabel("cross entropy (nats/token)")

    lr = finite_points(train, "lr")
    if lr:
        ax_lr.plot(*zip(*lr), color="tab:green", linewidth=1.4)
    ax_lr.set_title("learning rate")
    ax_lr.set_ylabel("lr")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    steady = steady_records(train)
    tps = finite_points(steady, "tokens_per_s")
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

    used, peak = finite_points(train, "mem_used_gb"), finite_points(train, "mem_peak_gb")
    if used:
        ax_mem.plot(*zip(*used), color="tab:cyan", linewidth=1.4, label="used")
    if peak:
        ax_mem.plot(*zip(*peak), color="tab:brown", linewidth=1.2, linestyle="--", label="peak")
    totals = finite_points(train, "mem_total_gb")
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


def eval_tasks(evals: list[dict]) -> list[str]:
    """The tasks of a run's [eval] records (eval/<task>/<metric> keys), in the order first logged."""
    return list(dict.fromkeys(k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.count("/") >= 2))


def _plot_eval(ax, evals: list[dict], task: str) -> None:
    """One task's metrics against step: scores (acc, ...) on the left axis, perplexities on a log axis at right."""
    prefix = f"eval/{task}/"
    keys = list(dict.fromkeys(k for r in evals for k in r if k.startswith(prefix)))
    ppl_keys = [k for k in keys if "perplexity" in k]
    ax_ppl = ax.twinx() if ppl_keys else None
    for i, key in enumerate(keys):
        points = finite_points(evals, key)
        target = ax_ppl if key in ppl_keys else ax
        if points:
            target.plot(*zip(*points), marker="o", markersize=4, linewidth=1.4, label=key[len(prefix):],
                        linestyle="--" if target is ax_ppl else "-", color=f"C{i}")
    if ax_ppl is not None:
        ax_ppl.set_yscale("log")
        ax_ppl.set_ylabel("perplexity (log)")
    ax.set_title(f"eval: {task} (lm-evaluation-harness)")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    handles = [h for a in (ax, ax_ppl) if a is not None for h in zip(*a.get_legend_handles_labels())]
    if handles:
        ax.legend(*zip(*handles), fontsize=8)


def source_tokens(train: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """A data mixture's tokens seen per source against step ({} for one source)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in train:
        for k, v in r.items():
            if k.startswith("tokens/") and isinstance(v, (int, float)):
                out.setdefault(k[len("tokens/"):], []).append((r["step"], float(v)))
    return out


def _plot_mixture(ax, mix: dict[str, list[tuple[int, float]]]) -> None:
    """The data panel: tokens seen per source against step; the legend gives each one's last share."""
    total = sum(points[-1][1] for points in mix.values()) or 1.0
    for name, points in mix.items():
        ax.plot(*zip(*points), linewidth=1.4, label=f"{name} ({100 * points[-1][1] / total:.1f}%)")
    ax.set_title("tokens seen per data source")
    ax.set_ylabel("tokens")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_report(run: RunMetrics, out_png: Path, title: str = "") -> Path:
    """Save build_figure's plots as a PNG (atomically)."""
    plt = require_matplotlib()
    fig = build_figure(run, title)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out_png) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return out_png

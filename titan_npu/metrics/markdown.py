"""report.md: the run's figures as a markdown table, its checkpoints, and where the numbers come from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from titan_npu.config.mixture import default_name
from titan_npu.metrics.mixture import SHARE, TOKENS
from titan_npu.metrics.run_metrics import RunMetrics
from titan_npu.metrics.summary import human, summary

REPORT_HEADING = "# Run report: "  # report.md's first line: how a report titan-npu wrote is recognised


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


def mixture_table(run: RunMetrics, data: dict[str, Any]) -> list[str]:
    """## Data mixture: per source its weight, tokens seen, share and last validation loss ([] for one source)."""
    last = next((r for r in reversed(run.train) if any(k.startswith(TOKENS) for k in r)), None)
    if last is None:
        return []
    val = next((r for r in reversed(run.val) if any(k.startswith("val_loss/") for k in r)), {})
    sources = data.get("sources") or []
    total_w = sum(float(s.get("weight", 0)) for s in sources) or 1.0
    weights = {s.get("name") or default_name(s.get("path", "")): float(s.get("weight", 0)) / total_w
               for s in sources}
    lines = [f"## Data mixture (step {last['step']})", "", "| source | weight | tokens seen | share | val loss |",
             "|---|---|---|---|---|"]
    for key, tokens in last.items():
        if key.startswith(TOKENS):
            name = key[len(TOKENS):]
            lines.append(f"| {name} | {_fmt(weights.get(name), '.3f')} | {tokens:,} | "
                         f"{_fmt(last.get(SHARE + name), '.3f')} | {_fmt(val.get('val_loss/' + name))} |")
    return lines + [""]


def conversations_table(info: dict[str, Any]) -> list[str]:
    """## Chat data: per source the conversations kept, windows, truncated and dropped ([] for text)."""
    counts = info.get("conversations")
    if not isinstance(counts, dict) or not counts:
        return []
    lines = ["## Chat data (data.format chat / instruction)", "",
             "| source | conversations | windows | truncated | dropped |", "|---|---|---|---|---|"]
    for name, c in counts.items():
        if isinstance(c, dict):
            lines.append(f"| {name} | " + " | ".join(f"{c.get(k, '')}" for k in
                                                      ("conversations", "windows", "truncated", "dropped")) + " |")
    return lines + [""]


def eval_table(run: RunMetrics) -> list[str]:
    """The [eval] results of the run's last evaluation, a row per task and metric, and the time evaluation took."""
    if not run.evals:
        return []
    last = run.evals[-1]
    total = sum(r.get("eval_time_s", 0.0) for r in run.evals if isinstance(r.get("eval_time_s"), float))
    lines = [f"## Evaluation (lm-evaluation-harness, step {last['step']}; {len(run.evals)} evaluation(s), "
             f"{total:.1f}s in all, not counted in throughput)", "", "| task | metric | value |", "|---|---|---|"]
    for key, value in last.items():
        if key.startswith("eval/") and key.count("/") >= 2:
            _, task, metric = key.split("/", 2)
            lines.append(f"| {task} | {metric} | {_fmt(value)} |")
    return lines + [""]


def render_markdown(log_dir: Path, run: RunMetrics, config: dict[str, Any], info: dict[str, Any],
                    png_name: str | None) -> str:
    """report.md's text."""
    s = summary(run)
    m, t = config.get("model", {}), config.get("training", {})
    opt, sched, data = config.get("optimizer", {}), config.get("lr_scheduler", {}), config.get("data", {})
    rows: list[tuple[str, str]] = []
    model = f"{m.get('name', '?')} {m.get('flavor', '')}".strip()
    if info.get("params"):
        model += f", {human(info['params'])} params ({human(info.get('non_embedding_params', 0))} non-embedding)"
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
    if data.get("sources"):
        rows.append(("data", f"a mixture of {len(data['sources'])} sources, below (tokenizer {data.get('tokenizer')})"))
    elif data:
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
        rows.append(("tokens seen", f"{tokens:,} ({human(tokens)})" if tokens else "n/a"))
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
    lines += mixture_table(run, data)
    lines += conversations_table(info)
    lines += eval_table(run)
    lines.append(f"## Checkpoints ({ckpt_dir if ckpt_dir else 'no checkpoint dir configured'})")
    lines.append("")
    entries = list_checkpoints(ckpt_dir)
    lines += [f"- {e}" for e in entries] if entries else ["none written"]
    lines.append("")
    notes = ["Source: metrics.jsonl, config.toml and run_info.json in this directory. Throughput and MFU are medians "
             "over the logged windows after the first; docs/metrics.md explains every figure."]
    if run.skipped_lines:
        notes.append(f"{run.skipped_lines} unreadable line(s) of metrics.jsonl were skipped (the first: "
                     f"{run.first_skipped}).")
    lines += notes + [""]
    return "\n".join(lines)

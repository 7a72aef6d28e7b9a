"""Fit the planner's compute efficiency per device type on the published runs and write what the planner reads.

    python benchmarks/calibrate.py            # refit, write titan_npu/planner/calibration.json, print the table
    python benchmarks/calibrate.py --check    # refit and compare with the stored file; exit 1 if they differ

The fit and the split are titan_npu/planner/calibration.py's; the runs are benchmarks/published/*.toml (each one
`titan-npu plan --reproduce benchmarks/published/<run>.toml`). The table printed is docs/planning.md's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_npu.atomic import atomic_write_text
from titan_npu.models.registry import build_model_args
from titan_npu.planner.calibration import FIT, HELD_OUT, calibrate, median_abs_error
from titan_npu.planner.efficiency import CALIBRATION_FILE, Calibration
from titan_npu.planner.layout import Layout
from titan_npu.planner.reproduce import PublishedRun, published_runs, reproduce

PUBLISHED = Path(__file__).resolve().parent / "published"


def short_layout(layout: Layout) -> str:
    """'FSDP 32 x TP 8', 'DP 4 x PP 2', 'TP 8 x PP 4 (4 stages/rank)'."""
    parts = []
    if layout.dp > 1:
        parts.append(f"{'FSDP' if layout.fsdp else 'DP'} {layout.dp}")
    parts += [f"{name} {n}" for name, n in (("TP", layout.tp), ("PP", layout.pp), ("CP", layout.cp)) if n > 1]
    stages = f" ({layout.stages_per_rank} stages/rank)" if layout.stages_per_rank > 1 else ""
    return " x ".join(parts) + stages


def markdown(cal: Calibration, runs: list[PublishedRun]) -> str:
    """The runs (model, cluster, layout, what was reported), their halves and ratios, both halves' errors."""
    by_id = {r.id: r for r in runs}
    lines = ["| run | source | model | cluster | layout | seq | global batch | AC | precision | published "
             "tokens/s/device | estimate | estimate / published | half |",
             "| --- | --- | --- | --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | --- |"]
    for row in cal.rows:
        run = by_id[row["id"]]
        layout, cfg = reproduce(run).candidate.layout, run.config
        ac = {"selective": "op-level selective" if layout.selective_ops else f"1 in {layout.selective_every}"}.get(
            layout.ac, layout.ac)
        args = build_model_args(cfg.model)
        precision = run.precision + (", compiled" if cfg.compile.enable else "")
        model = f"{cfg.model.name}, {args.num_params() / 1e9:.1f}B"
        lines.append(f"| `{row['id']}` | {row['source']} | {model} | {run.nodes} x "
                     f"{run.devices_per_node} {run.device} | {short_layout(layout)} | {cfg.training.seq_len} | "
                     f"{layout.local_batch * layout.dp} | {ac} | {precision} | {row['published']:,.1f} | "
                     f"{row['estimate']:,.1f} | {row['ratio']:.3f} | {row['half']} |")
    effs = ", ".join(f"{t} {100 * e:.1f}%" for t, e in cal.efficiency.items())
    lines += ["", f"fitted efficiency (fraction of bf16 peak): {effs}; median |estimate / published - 1|: "
              f"fit half {100 * cal.fit_error:.1f}%, held-out half {100 * cal.held_out_error:.1f}%"]
    for device_type in cal.efficiency:
        halves = [(half, [r["ratio"] for r in cal.rows if r["device_type"] == device_type and r["half"] == half])
                  for half in (FIT, HELD_OUT)]
        errors = [f"{half} {100 * median_abs_error(ratios):.1f}% ({len(ratios)} runs)" for half, ratios in halves]
        lines.append(f"- {device_type}: " + ", ".join(errors))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare the refit with the stored calibration, write nothing")
    args = p.parse_args()
    runs = published_runs(PUBLISHED)
    cal = calibrate(runs)
    text = json.dumps(cal.as_dict(), indent=1) + "\n"
    print(markdown(cal, runs))
    if args.check:
        same = CALIBRATION_FILE.read_text(encoding="utf-8") == text
        print(f"{CALIBRATION_FILE}: {'up to date' if same else 'STALE: rerun without --check'}")
        return 0 if same else 1
    atomic_write_text(CALIBRATION_FILE, text)
    print(f"wrote {CALIBRATION_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
from titan_npu.planner.calibration import CALIBRATION_FILE, Calibration, calibrate
from titan_npu.planner.reproduce import published_runs

PUBLISHED = Path(__file__).resolve().parent / "published"


def markdown(cal: Calibration) -> str:
    """The runs, their halves and ratios, and both halves' errors as a markdown table."""
    lines = ["| run | source | device | half | published tokens/s/device | estimate | estimate / published |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for row in cal.rows:
        lines.append(f"| `{row['id']}` | {row['source']} | {row['device']} | {row['half']} | {row['published']:,.1f} "
                     f"| {row['estimate']:,.1f} | {row['ratio']:.3f} |")
    effs = ", ".join(f"{t} {100 * e:.1f}%" for t, e in cal.efficiency.items())
    lines += ["", f"fitted efficiency (fraction of bf16 peak): {effs}; median |estimate / published - 1|: "
              f"fit half {100 * cal.fit_error:.1f}%, held-out half {100 * cal.held_out_error:.1f}%"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare the refit with the stored calibration, write nothing")
    args = p.parse_args()
    cal = calibrate(published_runs(PUBLISHED))
    text = json.dumps(cal.as_dict(), indent=1) + "\n"
    print(markdown(cal))
    if args.check:
        same = CALIBRATION_FILE.read_text(encoding="utf-8") == text
        print(f"{CALIBRATION_FILE}: {'up to date' if same else 'STALE: rerun without --check'}")
        return 0 if same else 1
    atomic_write_text(CALIBRATION_FILE, text)
    print(f"wrote {CALIBRATION_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

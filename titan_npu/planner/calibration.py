"""The compute efficiency per device type, fitted on half of the published runs and checked on the other half.

The step model (perf.py) has one free number, the fraction of the device's bf16 peak that compute reaches. For each
device type (npu, cuda) it is the value at which the planner's median estimate / published ratio over the fit half
of that type's published runs is 1 (the ratio rises with the efficiency, so a bisection finds it). The split is
fixed: the runs sorted by (source, id), alternate ones fitted (0th, 2nd, ...) and the others held out. The median
absolute percentage error of the held-out half is the error band the planner prints beside every estimate.

`python benchmarks/calibrate.py` refits and writes calibration.json; the planner reads only that file
(efficiency.py), and tests/tools/test_plan_published.py holds it equal to a refit of benchmarks/published/.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from titan_npu.planner.efficiency import DEFAULT_EFFICIENCY, Calibration
from titan_npu.planner.reproduce import PublishedRun, reproduce

FIT, HELD_OUT = "fit", "held-out"


def split(runs: Sequence[PublishedRun]) -> dict[str, str]:
    """Each run's half: the runs sorted by (source, id), the 0th, 2nd, 4th ... fitted, the others held out."""
    ordered = sorted(runs, key=lambda r: (r.source, r.id))
    return {r.id: FIT if i % 2 == 0 else HELD_OUT for i, r in enumerate(ordered)}


def fit_efficiency(ratio_at: Callable[[float], list[float]], low: float = 0.05, high: float = 1.0) -> float:
    """The efficiency in [low, high] at which the median of ratio_at(efficiency) is 1 (to 1e-4), by bisection."""
    for _ in range(20):
        mid = (low + high) / 2
        if statistics.median(ratio_at(mid)) < 1:
            low = mid
        else:
            high = mid
    return round((low + high) / 2, 4)


def median_abs_error(ratios: Sequence[float]) -> float:
    """Median of |estimate / published - 1|."""
    return statistics.median(abs(r - 1) for r in ratios)


def calibrate(runs: Sequence[PublishedRun]) -> Calibration:
    """Fit the efficiency of each device type on its fit-half runs; report both halves' errors at the fit."""
    halves = split(runs)
    types = {r.id: reproduce(r, 1.0).hw.device_type for r in runs}
    efficiency = {}
    for device_type in sorted(set(types.values())):
        fitted = [r for r in runs if types[r.id] == device_type and halves[r.id] == FIT]
        if not fitted:
            continue
        efficiency[device_type] = fit_efficiency(lambda e, fitted=fitted: [reproduce(r, e).ratio for r in fitted])
    rows = []
    for r in sorted(runs, key=lambda r: (r.source, r.id)):
        eff = efficiency.get(types[r.id], DEFAULT_EFFICIENCY)
        rep = reproduce(r, eff)
        rows.append({"id": r.id, "source": r.source, "device": r.device, "device_type": types[r.id],
                     "half": halves[r.id], "published": r.tokens_per_s_per_device,
                     "estimate": round(rep.tokens_per_s_per_device, 1), "ratio": round(rep.ratio, 4)})
    errors = {h: round(median_abs_error([row["ratio"] for row in rows if row["half"] == h]), 4)
              for h in (FIT, HELD_OUT)}
    return Calibration(efficiency, errors[FIT], errors[HELD_OUT], rows)

"""The planner's compute efficiency per device type and its measured error band, read from calibration.json (fitted
on published runs by calibration.py, written by `python benchmarks/calibrate.py`). Apart from the fit, so that the
step model reads the result without importing the planning it is fitted with."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
# Device types without published runs (cpu) keep the planner's former assumption.
DEFAULT_EFFICIENCY = 0.4


@dataclass(frozen=True)
class Calibration:
    """Fitted efficiencies per device type, each half's median absolute error, and every run's ratio."""

    efficiency: dict[str, float]
    fit_error: float
    held_out_error: float
    rows: list[dict]  # id, source, device, device_type, half, published, estimate, ratio (tokens/s per device)

    def as_dict(self) -> dict:
        return {"efficiency": self.efficiency, "fit_error": self.fit_error, "held_out_error": self.held_out_error,
                "rows": self.rows}


@functools.lru_cache(maxsize=1)
def load_calibration(path: Path = CALIBRATION_FILE) -> Calibration:
    """The calibration the planner uses (calibration.json, written by benchmarks/calibrate.py)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return Calibration(data["efficiency"], data["fit_error"], data["held_out_error"], data["rows"])


def calibrated_efficiency(device_type: str) -> float:
    """The fitted compute efficiency of a device type (DEFAULT_EFFICIENCY where no published run covers it)."""
    return load_calibration().efficiency.get(device_type, DEFAULT_EFFICIENCY)


def error_band() -> float:
    """The planner's measured error: the held-out published runs' median |estimate / published - 1|."""
    return load_calibration().held_out_error

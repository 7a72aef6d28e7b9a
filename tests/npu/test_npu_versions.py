"""The versions the NPU path states: the torch floor in pyproject.toml and docs/npu.md is the code's, the install
lines name the tested torch / torch_npu pair, and doctor's compatibility table agrees with the table the pinned
torch_npu wheel ships."""

from __future__ import annotations

import re
from pathlib import Path

from titan_npu.device.npu import MIN_TORCH, TESTED_TORCH_NPU
from titan_npu.tools import doctor

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_states_the_codes_torch_floor():
    floors = re.findall(r'^\s*"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert floors == [MIN_TORCH]


def test_docs_state_the_floor_and_install_the_tested_pair():
    text = (REPO / "docs" / "npu.md").read_text()
    assert f"torch >= {MIN_TORCH}" in text
    assert f'pip install "torch=={TESTED_TORCH_NPU}"' in text and f'"torch_npu=={TESTED_TORCH_NPU}"' in text


def wheel_compatibility_rows(metadata: str) -> dict[str, str]:
    """{torch_npu version: CANN release} from the 'Ascend Auxiliary Software' table of the wheel's README."""
    rows: dict[str, str] = {}
    cann = None
    for line in metadata.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"[\d.]+(rc\d+|\.post\d+)?", cells[2]):
            continue
        if cells[0].startswith("CANN "):
            cann = cells[0].removeprefix("CANN ")
        if cann:
            rows[cells[2]] = cann
    return rows


def test_doctors_table_agrees_with_the_table_the_pinned_wheel_ships(torch_npu_wheel):
    rows = wheel_compatibility_rows(torch_npu_wheel.read(torch_npu_wheel.METADATA_FILE))
    assert len(rows) > 30  # the table was found
    # The README lists pre-releases (rc) and 1.x releases that titan-npu cannot run on; every other row must agree.
    checked = {v: c for v, c in rows.items() if "rc" not in v and not v.startswith(("1.", "2.0."))}
    disagree = {v: (doctor.TORCH_NPU_CANN.get(v), c) for v, c in checked.items() if doctor.TORCH_NPU_CANN.get(v) != c}
    assert not disagree, f"torch_npu: (doctor, wheel) CANN releases differ: {disagree}"

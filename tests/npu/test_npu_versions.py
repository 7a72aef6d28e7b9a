"""The versions the NPU path states: the torch floor in pyproject.toml and docs/npu.md is the code's, the tested
torch / torch_npu pairs are the published wheels tests/npu reads, pyproject's npu extras and the install lines name
them, and doctor's CANN table agrees with what each wheel's README says."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from titan_npu.device.npu import MIN_TORCH, TESTED_TORCH_NPU
from titan_npu.tools import doctor

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_states_the_codes_torch_floor():
    floors = re.findall(r'^\s*"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert floors == [MIN_TORCH]


def test_the_tested_pairs_are_the_wheels_the_fake_and_the_contract_tests_read(torch_npu_wheel):
    assert torch_npu_wheel.TORCH_NPU_VERSIONS == TESTED_TORCH_NPU


def test_each_npu_extra_pins_a_tested_pair_as_the_wheel_pins_its_torch(each_torch_npu_wheel):
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    version = each_torch_npu_wheel.version
    pair = [f"torch=={each_torch_npu_wheel.torch_requirement()}.*", f"torch_npu=={version}"]
    assert pair in [deps for name, deps in extras.items() if name.startswith("npu")], pair
    assert extras["npu"] == [f"torch=={TESTED_TORCH_NPU[-1]}.*", f"torch_npu=={TESTED_TORCH_NPU[-1]}"]  # the newest


def test_docs_state_the_floor_and_install_each_tested_pair():
    text = (REPO / "docs" / "npu.md").read_text()
    assert f"torch >= {MIN_TORCH}" in text
    for version in TESTED_TORCH_NPU:
        assert f'pip install "torch=={version}"' in text and f'"torch_npu=={version}"' in text, version


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


def test_doctors_table_agrees_with_the_table_each_wheel_ships(each_torch_npu_wheel):
    text = each_torch_npu_wheel.read(each_torch_npu_wheel.METADATA_FILE)
    rows = wheel_compatibility_rows(text)
    if not rows:  # 2.14.0's README carries no table: it points to a file the wheel does not ship
        assert "please refer to [Compatibility](./COMPATIBILITY.en.md)" in text
        return
    assert len(rows) > 30  # the table was found
    # The README lists pre-releases (rc) and 1.x releases that titan-npu cannot run on; every other row must agree.
    checked = {v: c for v, c in rows.items() if "rc" not in v and not v.startswith(("1.", "2.0."))}
    disagree = {v: (doctor.TORCH_NPU_CANN.get(v), c) for v, c in checked.items() if doctor.TORCH_NPU_CANN.get(v) != c}
    assert not disagree, f"torch_npu: (doctor, wheel) CANN releases differ: {disagree}"


def test_doctor_pairs_each_tested_torch_npu_with_the_cann_the_newest_wheels_readme_installs(torch_npu_wheel):
    newest = torch_npu_wheel.WHEELS[TESTED_TORCH_NPU[-1]]
    installs = re.findall(r"^Install CANN ([\w.]+) ", newest.read(newest.METADATA_FILE), flags=re.MULTILINE)
    assert len(installs) == 1
    # one source tree builds every tested release (2.13.0's README: "supported on this branch: 2.13.0, 2.14.0, ...")
    oldest = torch_npu_wheel.WHEELS[TESTED_TORCH_NPU[0]]
    branch = re.search(r"supported on this branch: ([\d., ]+);", oldest.read(oldest.METADATA_FILE))
    assert branch and set(TESTED_TORCH_NPU) <= {v.strip() for v in branch.group(1).split(",")}
    assert {v: doctor.TORCH_NPU_CANN.get(v) for v in TESTED_TORCH_NPU} == dict.fromkeys(TESTED_TORCH_NPU, installs[0])

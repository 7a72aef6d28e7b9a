"""The planner against published training runs: every run in benchmarks/published/ reproduces, the stored
calibration is the fit of those runs, its held-out error is the band the planner prints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from titan_npu.commands import plan as plan_command
from titan_npu.config.loader import load_config
from titan_npu.errors import ConfigError
from titan_npu.planner.calibration import FIT, HELD_OUT, calibrate, split
from titan_npu.planner.efficiency import error_band, load_calibration
from titan_npu.planner.hardware import hardware
from titan_npu.planner.reproduce import load_published, published_runs, reproduce
from titan_npu.planner.search import make_plan

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "published"
RUNS = sorted(PUBLISHED.glob("*.toml"))


def test_the_published_table_holds_at_least_12_runs_from_more_than_one_source_and_device_type():
    runs = published_runs(PUBLISHED)
    assert len(runs) >= 12
    assert len({r.source for r in runs}) >= 2
    assert {reproduce(r).hw.device_type for r in runs} == {"npu", "cuda"}


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_every_published_run_reproduces_with_its_citation(path):
    run = load_published(path)
    assert run.citation.startswith("https://github.com/") and "/blob/" in run.citation
    rep = reproduce(run)
    assert rep.candidate.layout.world_size == run.nodes * run.devices_per_node
    assert math.isfinite(rep.ratio) and rep.ratio > 0
    assert rep.ratio == pytest.approx(rep.tokens_per_s_per_device / run.tokens_per_s_per_device)


def test_plan_reproduce_prints_the_estimate_beside_the_published_figure(capsys):
    path = PUBLISHED / "torchtitan_llama3_8b_fsdp8.toml"
    assert plan_command.main(["--reproduce", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rep = reproduce(load_published(path))
    assert out["published_tokens_per_s_per_device"] == 5762
    assert out["ratio"] == pytest.approx(rep.ratio)
    assert out["estimate_error_band"] == error_band()
    assert plan_command.main(["--reproduce", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"estimate / published: {rep.ratio:.3f}" in text and f"±{100 * error_band():.0f}%" in text


def test_the_split_alternates_the_runs_sorted_by_source_and_fits_each_device_type_on_its_half():
    runs = published_runs(PUBLISHED)
    halves = split(runs)
    ordered = sorted(runs, key=lambda r: (r.source, r.id))
    assert [halves[r.id] for r in ordered] == [FIT if i % 2 == 0 else HELD_OUT for i in range(len(ordered))]
    # Changing a held-out run's published figure leaves the fitted efficiencies alone.
    held = next(r for r in ordered if halves[r.id] == HELD_OUT)
    moved = [r if r is not held else type(r)(**{**r.__dict__, "tokens_per_s_per_device": 1.0}) for r in runs]
    assert calibrate(moved).efficiency == calibrate(runs).efficiency


def test_the_stored_calibration_is_the_fit_of_the_published_runs():
    stored, refit = load_calibration(), calibrate(published_runs(PUBLISHED))
    assert stored.efficiency == pytest.approx(refit.efficiency, abs=1e-4), "run python benchmarks/calibrate.py"
    assert stored.fit_error == pytest.approx(refit.fit_error, abs=1e-4)
    assert stored.held_out_error == pytest.approx(refit.held_out_error, abs=1e-4)
    assert [r["id"] for r in stored.rows] == [r["id"] for r in refit.rows]


def test_held_out_published_runs_are_within_20_percent_median_error():
    cal = load_calibration()
    held = [row["ratio"] for row in cal.rows if row["half"] == HELD_OUT]
    assert len(held) >= 6
    assert cal.held_out_error == error_band() <= 0.20


def test_the_plan_uses_the_calibrated_efficiency_and_prints_its_error_band_beside_every_estimate():
    cfg = load_config(ROOT / "configs" / "llama_7b.toml")
    plan = make_plan(cfg, 1, 4, hardware("910B2"), top=3)
    assert plan.efficiency == load_calibration().efficiency["npu"]
    text = plan_command.format_plan(plan)
    band = f"±{100 * error_band():.0f}%"
    assert f"estimate: {plan.config_candidate.step.tokens_per_s:,.0f} tokens/s ({band})" in text
    assert f"fastest first (tokens/s {band})" in text
    assert make_plan(cfg, 1, 4, hardware("910B2"), efficiency=0.3, top=1).efficiency == 0.3


def test_a_published_run_without_its_published_section_is_refused_with_the_keys_to_add(tmp_path):
    bare = tmp_path / "run.toml"
    bare.write_text('[model]\nname = "llama3"\nflavor = "8B"\n')
    with pytest.raises(ConfigError, match=r"no \[published\] section.*citation"):
        load_published(bare)
    partial = tmp_path / "partial.toml"
    partial.write_text('[published]\nsource = "x"\n\n[model]\nname = "llama3"\nflavor = "8B"\n')
    with pytest.raises(ConfigError, match="lacks citation"):
        load_published(partial)

"""The run report: plots and summary from a recorded metrics.jsonl, and `titan-npu report LOG_DIR`."""

import json
import math
import shutil
from pathlib import Path

import pytest

from titan_npu.cli import main as cli_main
from titan_npu.errors import DataError
from titan_npu.metrics.plots import build_figure
from titan_npu.metrics.report import write_report
from titan_npu.metrics.run_metrics import read_metrics
from titan_npu.metrics.summary import summary

# Recorded from a real run: the debug config shrunk to dim 64 / 2 layers, 60 steps, log every 5, validation every
# 20, checkpoints at 30 and 60, and a NaN loss injected at step 33 (tests/fault_hooks.py, flagged on step 35's line).
RECORDED = Path(__file__).parent / "data" / "recorded_run"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(RECORDED, d)
    return d


def test_recorded_metrics_are_read_into_train_and_validation_records():
    run = read_metrics(RECORDED)
    assert [r["step"] for r in run.train] == [1, *range(5, 61, 5)]
    assert [r["step"] for r in run.val] == [20, 40, 60]
    assert run.skipped_lines == 0


def test_summary_figures_of_the_recorded_run():
    lines = [json.loads(x) for x in (RECORDED / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    s = summary(read_metrics(RECORDED))
    assert s["final_loss"] == (60, train[-1]["loss"])
    best = min(train, key=lambda r: r["loss"])
    assert s["best_loss"] == (best["step"], best["loss"])
    assert s["tokens_seen"] == 60 * 8 * 64
    steady = sorted(r["tokens_per_s"] for r in train[1:])  # the first window (start-up) is left out
    assert s["median_tokens_per_s"] == pytest.approx((steady[5] + steady[6]) / 2)
    assert s["peak_mem_gb"] == max(r["mem_peak_gb"] for r in train)
    assert s["flags"] == [(35, "nonfinite_loss step=33")]
    assert s["best_val"][0] == 60 and s["best_val"][2] == pytest.approx(math.exp(s["best_val"][1]))


def test_figure_has_four_labelled_panels_against_step():
    fig = build_figure(read_metrics(RECORDED), title="recorded")
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["loss", "learning rate", "throughput (first logged window left out)",
                                               "memory (device total 23.5 GB)"]
    for ax in axes:
        assert ax.get_xlabel() == "step" and ax.get_ylabel()
    loss_ax = axes[0]
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["train", "validation", "flagged step"]
    train_line = loss_ax.get_lines()[0]
    assert list(train_line.get_xdata()) == [1, *range(5, 61, 5)]
    assert [c.get_ylabel() for c in axes[2].child_axes] == ["MFU (%)"]  # a second scale on the throughput line


def test_report_png_and_markdown_are_written(run_dir):
    ckpt = run_dir / "ckpt-of-recorded-run" / "step-60"  # a complete checkpoint has both marker files
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"x" * 1024)
    (ckpt / "checkpoint.json").write_text("{}")
    written = write_report(run_dir)
    assert written == [run_dir / "report.png", run_dir / "report.md"]
    png = (run_dir / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1320, 825)  # 12 x 7.5 inches at 110 dpi
    md = (run_dir / "report.md").read_text()
    for row in ("| model | llama3 debug", "| tokens seen | 30,720", "| final loss | ", "| best val loss | ",
                "| median throughput | ", "| median MFU | ", "| peak memory | ", "| flags | 1: step 35"):
        assert row in md
    assert "- step-60 (step 60," in md
    assert not list(run_dir.glob(".report*"))  # no temporary files left behind


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path):
    rec = {"lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
    lines = [dict(rec, step=s, loss=10.0 - s) for s in (1, 10, 20, 30)]
    lines += [dict(rec, step=s, loss=5.0) for s in (21, 30, 40)]  # resumed from the step-20 checkpoint
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in run.train] == [(1, 9.0), (10, 0.0), (20, -10.0), (21, 5.0), (30, 5.0),
                                                           (40, 5.0)]


def test_nan_strings_and_a_torn_last_line_are_handled(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 7.0, "lr": 0.001, "grad_norm": 1.0}\n'
        '{"step": 2, "loss": "nan", "lr": 0.001, "grad_norm": "inf"}\n'
        '{"step": 3, "loss": 6.'
    )
    run = read_metrics(tmp_path)
    assert math.isnan(run.train[1]["loss"]) and run.train[1]["grad_norm"] == math.inf
    assert run.skipped_lines == 1
    assert summary(run)["best_loss"] == (1, 7.0)


def test_report_command_writes_into_out_dir(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["report", str(run_dir), "--out", str(out)]) == 0
    assert (out / "report.png").is_file() and (out / "report.md").is_file()
    assert capsys.readouterr().out.split() == [str(out / "report.png"), str(out / "report.md")]


def test_report_without_plots_needs_no_matplotlib(run_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli_main(["report", str(run_dir), "--no-plots"]) == 0
    assert not (run_dir / "report.png").exists() and (run_dir / "report.md").is_file()
    assert cli_main(["report", str(run_dir)]) == 2  # asked for plots: a one-line error naming the fix


def test_missing_log_dir_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(DataError, match="give the metrics.log_dir of a run"):
        read_metrics(tmp_path / "nope")
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def _moe_run(tmp_path: Path, layers: int) -> Path:
    """A MoE model's metrics.jsonl: steps 1, 5, .., 25 with the expert load falling towards even."""
    lines = [{"step": s, "loss": 8.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 100.0, "expert_load_max_mean": 2.0 - s / 50,
              "expert_load_per_layer": [2.0 - s / 50 + 0.1 * (i - (layers - 1) / 2) for i in range(layers)]}
             for s in (1, 5, 10, 15, 20, 25)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path


def test_a_moe_run_gets_an_expert_load_panel_with_each_layer_and_their_mean(tmp_path):
    fig = build_figure(read_metrics(_moe_run(tmp_path, layers=2)))
    assert len(fig.axes) == 5
    load_ax = fig.axes[4]
    assert load_ax.get_title() == "expert load (MoE layers)" and load_ax.get_xlabel() == "step"
    labels = [t.get_text() for t in load_ax.get_legend().get_texts()]
    assert labels == ["layer 0", "layer 1", "mean over layers", "even"]
    mean_line = load_ax.get_lines()[2]
    assert list(mean_line.get_xdata()) == [1, 5, 10, 15, 20, 25]
    assert list(mean_line.get_ydata()) == pytest.approx([2.0 - s / 50 for s in (1, 5, 10, 15, 20, 25)])
    assert list(load_ax.get_lines()[1].get_ydata())[0] == pytest.approx(2.0 - 1 / 50 + 0.05)


def test_many_moe_layers_share_one_legend_entry_and_the_summary_gives_the_load(tmp_path):
    run = read_metrics(_moe_run(tmp_path, layers=12))
    load_ax = build_figure(run).axes[4]
    assert [t.get_text() for t in load_ax.get_legend().get_texts()] == ["per layer", "mean over layers", "even"]
    assert len(load_ax.get_lines()) == 12 + 2
    md = (write_report(tmp_path, plots=False)[0]).read_text()
    assert "| expert load | max / mean tokens per expert, mean over the MoE layers: median 1.75, 1.50 at step 25" in md


def test_a_dense_run_has_no_expert_load_panel_or_row(run_dir):
    assert len(build_figure(read_metrics(run_dir)).axes) == 4
    assert "expert load" not in write_report(run_dir, plots=False)[0].read_text()

"""[eval] inside a run: at eval.interval and at the last step the current weights are scored on a shipped task,
the results reach metrics.jsonl, the console (one line) and the report; the time is kept out of throughput; an
evaluation that raises is one logged line and training goes on; a mistake in [eval] stops the run at its start."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_run import refusal_line, tiny_args  # noqa: E402

pytest.importorskip("lm_eval")

EVAL = {"eval__enable": True, "eval__interval": 2, "eval__limit": 3, "eval__tasks": '["titan_mc"]'}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_a_run_evaluates_at_the_interval_and_the_last_step(tmp_path, capsys, one_thread):
    from titan_npu.cli import main

    assert main(["train", *tiny_args(tmp_path, training__max_steps=3, metrics__report=True, **EVAL)]) == 0
    evals = [r for r in _records(tmp_path) if "eval_time_s" in r]
    assert [r["step"] for r in evals] == [2, 3]
    assert all(0 <= r["eval/titan_mc/acc"] <= 1 and r["eval_time_s"] > 0 for r in evals)
    lines = [m for m in capsys.readouterr().out.splitlines() if m.startswith("[Eval ")]
    assert len(lines) == 2 and "titan_mc acc=" in lines[0] and "not counted in throughput" in lines[0]
    assert "## Evaluation" in (tmp_path / "logs" / "report.md").read_text()
    steps = [r for r in _records(tmp_path) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and not any(k.startswith("eval") for r in steps for k in r)


def test_an_evaluation_that_raises_is_one_line_and_training_continues(tmp_path, capsys, monkeypatch, one_thread):
    from titan_npu.cli import main
    from titan_npu.eval import harness

    def broken(*args, **kwargs):
        raise RuntimeError("the harness broke\nsecond line of its message")

    monkeypatch.setattr(harness, "run_tasks", broken)
    assert main(["train", *tiny_args(tmp_path, training__max_steps=3, **EVAL)]) == 0
    out, err = capsys.readouterr()
    failed = [m for m in (out + err).splitlines() if "evaluation failed" in m]
    assert failed == ["[Eval 2] evaluation failed (RuntimeError: the harness broke); training continues",
                      "[Eval 3] evaluation failed (RuntimeError: the harness broke); training continues"]
    assert [r["step"] for r in _records(tmp_path) if "loss" in r] == [1, 2, 3]
    assert not [r for r in _records(tmp_path) if "eval_time_s" in r]
    assert (tmp_path / "ckpt" / "step-3").is_dir()


@pytest.mark.parametrize("extra, expected", [
    ({"eval__tasks": '["no_such_task"]'}, "unknown task 'no_such_task'"),
    ({"eval__num_fewshot": 11}, "pool of 10 few-shot examples"),
    ({"eval__interval": 0}, "eval.interval"),
    ({"eval__limit": -1}, "eval.limit"),
])
def test_a_mistake_in_eval_stops_the_run_at_its_start(tmp_path, capsys, extra, expected):
    line = refusal_line(capsys, ["train", *tiny_args(tmp_path, training__max_steps=2, **{**EVAL, **extra})])
    assert expected in line, line
    assert not (tmp_path / "ckpt").exists()

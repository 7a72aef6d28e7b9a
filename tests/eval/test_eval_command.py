"""`titan-npu eval`: a checkpoint evaluated on a shipped task writes its results file; every mistake (an unknown task,
a checkpoint of another family than --config, more few-shot examples than the task has, --limit 0 or below, a
dataset not on disk, an output it must not replace) is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from eval_checkpoints import tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_run import refusal_line, snapshot  # noqa: E402

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("eval"), "llama")


def test_eval_writes_results_of_a_shipped_task(ckpt, tmp_path, capsys, one_thread):
    from titan_npu.cli import main

    out = tmp_path / "results.json"
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "titan_mc,titan_corpus", "--limit", "4",
                 "--num-fewshot", "2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "titan_mc: acc=" in printed and "titan_corpus: word_perplexity=" in printed
    results = json.loads(out.read_text())
    assert results["format"] == "titan-npu-eval" and results["num_fewshot"] == 2
    assert 0 <= results["results"]["titan_mc"]["acc"] <= 1 and results["n_samples"]["titan_mc"]["effective"] == 4
    # --overwrite replaces an earlier results file of the command (and only that).
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "titan_mc", "--limit", "2", "--output", str(out),
                 "--overwrite"]) == 0
    assert json.loads(out.read_text())["limit"] == 2


def _other_family_config(tmp_path: Path) -> Path:
    config = tmp_path / "moe.toml"
    config.write_text('[model]\nname = "qwen3_moe"\ndim = 64\nn_layers = 2\nn_heads = 4\nn_experts = 4\ntop_k = 2\n'
                      'vocab_size = 320\n[data]\ntokenizer = "byte"\n')
    return config


def _include(tmp_path: Path, dataset: str) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "offline_task.yaml").write_text(
        f"task: offline_task\ndataset_path: {dataset}\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: answer\n")
    return folder


@pytest.mark.parametrize("case, extra, expected", [
    ("unknown task", ["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    ("another family", ["--tasks", "titan_mc", "--config", "{moe}"], "describes a qwen3_moe model"),
    ("few-shot pool", ["--tasks", "titan_mc", "--num-fewshot", "11"], "pool of 10 few-shot examples"),
    ("few-shot pool of the test split", ["--tasks", "titan_cloze", "--num-fewshot", "60"], "pool of 59"),
    ("limit 0", ["--tasks", "titan_mc", "--limit", "0"], "--limit"),
    ("negative limit", ["--tasks", "titan_mc", "--limit", "-3"], "--limit"),
    ("negative few-shot", ["--tasks", "titan_mc", "--num-fewshot", "-1"], "--num-fewshot"),
    ("no task", ["--tasks", " , "], "names no task"),
    ("hub dataset not on disk", ["--tasks", "offline_task", "--include-path", "{hub}"], "could not be read offline"),
    ("missing include path", ["--tasks", "titan_mc", "--include-path", "{missing}"], "is not a folder"),
])
def test_bad_input_is_one_line_and_writes_nothing(ckpt, tmp_path, capsys, case, extra, expected):
    subs = {"{moe}": str(_other_family_config(tmp_path)), "{missing}": str(tmp_path / "nowhere")}
    if "{hub}" in extra:
        subs["{hub}"] = str(_include(tmp_path, "nobody-titan/not-a-dataset"))
    extra = [subs.get(a, a) for a in extra]
    out = tmp_path / "results.json"
    before, ckpt_before = snapshot(tmp_path), snapshot(ckpt)
    line = refusal_line(capsys, ["eval", "--checkpoint", str(ckpt), "--output", str(out), *extra])
    assert expected in line, line
    assert snapshot(tmp_path) == before and snapshot(ckpt) == ckpt_before


def test_an_output_it_did_not_write_is_never_replaced(ckpt, tmp_path, capsys):
    theirs = tmp_path / "notes.json"
    theirs.write_text('{"mine": true}')
    line = refusal_line(capsys, ["eval", "--checkpoint", str(ckpt), "--tasks", "titan_mc", "--output", str(theirs),
                                 "--overwrite"])
    assert "is not an earlier eval results file" in line and theirs.read_text() == '{"mine": true}'
    inside = refusal_line(capsys, ["eval", "--checkpoint", str(ckpt), "--tasks", "titan_mc",
                                   "--output", str(ckpt / "results.json")])
    assert "lies inside the checkpoint" in inside and not (ckpt / "results.json").exists()


def test_titan_npu_imports_without_lm_eval():
    """lm_eval is imported only when an evaluation runs: the CLI, the trainer and the eval command load without it."""
    import subprocess

    code = ("import sys; import titan_npu, titan_npu.cli, titan_npu.trainer.trainer, titan_npu.commands.eval, "
            "titan_npu.eval, titan_npu.metrics.plots, titan_npu.metrics.markdown; "
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-1000:]


def test_without_lm_eval_the_command_says_how_to_install_it(ckpt, tmp_path):
    import subprocess

    code = ("import sys; sys.modules['lm_eval'] = None; from titan_npu.cli import main; "
            f"sys.exit(main(['eval', '--checkpoint', {str(ckpt)!r}, '--tasks', 'titan_mc', "
            f"'--output', {str(tmp_path / 'r.json')!r}]))")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "ConfigError: titan-npu eval needs lm-evaluation-harness: pip install 'titan-npu[eval]'"]
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("target, expected", [
    ("the checkpoint", "is the checkpoint"),
    ("a file in the checkpoint", "lies inside the checkpoint"),
    ("a folder of the user's", "is a folder; give a file name"),
    ("a file of the user's", "notes.txt"),
])
def test_an_output_that_would_lose_something_is_refused(ckpt, tmp_path, capsys, target, expected, overwrite):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("keep")
    (tmp_path / "notes.txt").write_text("notes")
    out = {"the checkpoint": ckpt, "a file in the checkpoint": ckpt / "checkpoint.json",
           "a folder of the user's": tmp_path / "mine", "a file of the user's": tmp_path / "notes.txt"}[target]
    if target == "a folder of the user's" and not overwrite:
        expected = "already exists"
    before, ckpt_before = snapshot(tmp_path), snapshot(ckpt)
    line = refusal_line(capsys, ["eval", "--checkpoint", str(ckpt), "--tasks", "titan_mc", "--output", str(out),
                                 *(["--overwrite"] if overwrite else [])])
    assert expected in line, line
    assert snapshot(tmp_path) == before and snapshot(ckpt) == ckpt_before

"""No command deletes or replaces what it did not write, whatever --overwrite says (titan_npu/outputs.py).

Every command that writes (train's metrics.log_dir and checkpoint.dir, its dry run, prepare-data, import, export,
init-weights, train-tokenizer, report) is pointed at a checkpoint, at a prepared dataset and at a folder of the
user's own files, with and without --overwrite: it exits 2 with one line naming what would have been lost, and every
file there keeps its bytes. The fixtures (a real tiny three-step run, a prepared dataset, a folder of user files)
are built once for the module; a refused command changes nothing, so the cases share them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import TINY_RUN, snapshot, tiny_args, train_tiny

from titan_npu.cli import main as cli_main

from .conftest import REPO, clean_env

# The user's own folder: notes and code, and files named like those the commands write (a config they keep
# beside their logs, their own report, a tokenizer and metrics of another tool, a folder they called step-1).
USER_FILES = {
    "notes.txt": "a week of notes\n",
    "train_v2.py": "print('my training script')\n",
    "config.toml": "# my settings: lr found by hand\n[optimizer]\nlr = 1e-2\n",
    "metrics.jsonl": '{"my": "numbers"}\n',
    "report.md": "# my own report\n",
    "report.png": "not a plot\n",
    "tokenizer.json": "{}\n",
    "tokenizer_config.json": '{"mine": true}\n',
    "step-1/notes.txt": "a folder named like a checkpoint\n",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """One folder holding everything the cases point at: run/ (a real tiny run: ckpt/step-1..3, logs), prep/ (a
    prepared dataset), corpus/, mine/ (the user's files) and T.toml (the run's config)."""
    d = tmp_path_factory.mktemp("world")
    train_tiny(d / "run", steps=3, checkpoint__save_interval=1)
    (d / "corpus").mkdir()
    (d / "corpus" / "a.txt").write_text("\n\n".join(f"document {i} with some words" for i in range(20)))
    assert cli_main(["prepare-data", str(d / "corpus"), "--output", str(d / "prep"), "--progress", "lines"]) == 0
    for rel, text in USER_FILES.items():
        (d / "mine" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "mine" / rel).write_text(text)
    shutil.copy(d / "run" / "logs" / "config.toml", d / "T.toml")
    return d


# What each target is: (the folder itself, a path inside it, a file of it) by target name.
TARGETS = {
    "checkpoint": ("run/ckpt/step-3", "run/ckpt/step-3/out", "run/ckpt/step-3/ranks/rank-0.pt"),
    "prepared-dataset": ("prep", "prep/out", "prep/index.json"),
    "user-files": ("mine", "mine", "mine/notes.txt"),
}


def _train(out: str, key: str, overwrite: bool) -> list[str]:
    """A tiny run writing `key` (metrics.log_dir or checkpoint.dir) to `out`, the other folder to a fresh path."""
    other = "metrics.log_dir" if key == "checkpoint.dir" else "checkpoint.dir"
    return ["train", *TINY_RUN, f"--{key}", out, f"--{other}", "{d}/fresh", "--training.max_steps", "1",
            *(["--checkpoint.overwrite", "true"] if overwrite else [])]


def _flag(overwrite: bool) -> list[str]:
    return ["--overwrite"] if overwrite else []


# command -> (which of the target's paths it writes: 0 folder, 1 inside, 2 file; argv for output path and --overwrite)
COMMANDS = {
    "init-weights": ((0, 1), lambda out, ow: ["init-weights", "--config", "{d}/T.toml", "--output", out, *_flag(ow)]),
    "import": ((0, 1, 2), lambda out, ow: ["import", "--input", "{d}/run/ckpt/step-1", "--output", out, *_flag(ow)]),
    "export-pt": ((0, 1, 2), lambda out, ow: ["export", "--checkpoint", "{d}/run/ckpt/step-1", "--output", out,
                                              *_flag(ow)]),
    "export-hf": ((0, 1), lambda out, ow: ["export", "--checkpoint", "{d}/run/ckpt/step-1", "--format", "hf",
                                           "--output", out, *_flag(ow)]),
    # other settings than prep/ was made with: its own earlier output, prepared alike, would be up to date
    "prepare-data": ((0, 1), lambda out, ow: ["prepare-data", "{d}/corpus", "--output", out, "--doc-sep", "line",
                                              "--progress", "lines"]),
    "train-tokenizer": ((0, 1), lambda out, ow: ["train-tokenizer", "{d}/corpus", "--vocab-size", "300", "--output",
                                                 out]),
    "report": ((0, 1), lambda out, ow: ["report", "{d}/run/logs", "--out", out, "--no-plots"]),
    "train-log-dir": ((0, 1), lambda out, ow: _train(out, "metrics.log_dir", ow)),
    "train-checkpoint-dir": ((0, 1), lambda out, ow: _train(out, "checkpoint.dir", ow)),
    "dry-run": ((0, 1), lambda out, ow: [*_train(out, "checkpoint.dir", ow), "--dry-run", "--world-size", "1"]),
}
HAS_OVERWRITE = {"init-weights", "import", "export-pt", "export-hf", "train-log-dir", "train-checkpoint-dir", "dry-run"}

CASES = [(command, target, which, overwrite)
         for command, (paths, _) in COMMANDS.items() for target in TARGETS for which in dict.fromkeys(paths)
         if TARGETS[target][which] != TARGETS[target][0] or which == 0
         for overwrite in ((False, True) if command in HAS_OVERWRITE else (False,))]


def _refused(capsys, argv: list[str], d: Path) -> str:
    """Run argv in-process; assert exit 2, one line, no traceback and nothing under d changed; the line."""
    before = snapshot(d)
    capsys.readouterr()
    rc = cli_main([a.replace("{d}", str(d)) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in out + err, err
    assert snapshot(d) == before, "a refused command changed what was there"
    return lines[0]


@pytest.mark.parametrize("command, target, which, overwrite", CASES,
                         ids=[f"{c}-{t}-{['is', 'inside', 'file'][w]}{'-overwrite' if o else ''}"
                              for c, t, w, o in CASES])
def test_no_writing_command_touches_a_checkpoint_a_dataset_or_the_users_files(command, target, which, overwrite,
                                                                              world, capsys, one_thread,
                                                                              monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = "{d}/" + TARGETS[target][which]
    line = _refused(capsys, COMMANDS[command][1](out, overwrite), world)
    # The line names what is there: the checkpoint or the dataset, or the user's file or folder at stake.
    named = {"checkpoint": "checkpoint", "prepared-dataset": "prepared"}.get(target)
    if named is not None:
        assert named in line, line
    else:
        assert any(name.split("/")[0] in line for name in USER_FILES) or re.search(
            r"mine (already exists|is a directory|is a folder)", line), line


# ---- the four reported cases, as a user types them

def test_init_weights_overwrite_never_deletes_a_runs_checkpoints(world, capsys, tmp_path):
    ckcopy = tmp_path / "ckcopy"
    shutil.copytree(world / "run" / "ckpt", ckcopy)
    line = _refused(capsys, ["init-weights", "--config", str(world / "T.toml"), "--output", str(ckcopy),
                             "--overwrite"], tmp_path)
    assert "--overwrite would delete the checkpoints step-1, step-2, step-3" in line, line
    line = _refused(capsys, ["init-weights", "--config", str(world / "T.toml"), "--output", str(ckcopy / "step-3"),
                             "--overwrite"], tmp_path)
    assert f"is the checkpoint {(ckcopy / 'step-3').resolve()}; choose another path" in line, line


def test_init_weights_overwrite_never_deletes_a_folder_of_the_users_files(world, capsys, tmp_path):
    p = tmp_path / "p"
    p.mkdir()
    (p / "notes.txt").write_text("notes")
    (p / "train_v2.py").write_text("code")
    line = _refused(capsys, ["init-weights", "--config", str(world / "T.toml"), "--output", str(p), "--overwrite"],
                    tmp_path)
    assert "is not an earlier seed checkpoint; --overwrite would delete notes.txt, train_v2.py" in line, line


def test_init_weights_overwrite_replaces_its_own_seed_checkpoint_but_not_files_added_to_it(world, capsys, tmp_path):
    seed = tmp_path / "seed"
    argv = ["init-weights", "--config", str(world / "T.toml"), "--output", str(seed)]
    assert cli_main(argv) == 0
    assert cli_main([*argv, "--overwrite", "--training.seed", "7"]) == 0
    assert "seed = 7" in (seed / "config.toml").read_text()
    (seed / "README.md").write_text("where these weights come from")
    line = _refused(capsys, [*argv, "--overwrite"], tmp_path)
    assert "holds files an earlier seed checkpoint did not write; --overwrite would delete README.md" in line, line


def test_init_weights_never_removes_a_folder_in_the_way_of_its_temporary_name(world, capsys, tmp_path):
    (tmp_path / "seed.tmp").mkdir()
    (tmp_path / "seed.tmp" / "notes.txt").write_text("mine")
    line = _refused(capsys, ["init-weights", "--config", str(world / "T.toml"), "--output", str(tmp_path / "seed")],
                    tmp_path)
    assert "seed.tmp, where init-weights writes first, holds files it did not write" in line, line


def test_import_never_writes_into_a_checkpoint(world, capsys, tmp_path):
    ckcopy = tmp_path / "ckcopy"
    shutil.copytree(world / "run" / "ckpt", ckcopy)
    line = _refused(capsys, ["import", "--input", str(world / "run" / "ckpt" / "step-1"), "--output",
                             str(ckcopy / "step-3" / "ranks" / "rank-0.pt"), "--overwrite"], tmp_path)
    assert f"lies inside the checkpoint {(ckcopy / 'step-3').resolve()}; write to a path outside it" in line, line


def test_import_overwrite_replaces_an_earlier_weights_file_only(world, capsys, tmp_path):
    argv = ["import", "--input", str(world / "run" / "ckpt" / "step-1"), "--output", str(tmp_path / "w.pt")]
    assert cli_main(argv) == 0
    assert cli_main([*argv, "--overwrite", "--dtype", "bf16"]) == 0
    (tmp_path / "notes.pt").write_text("my notes, named oddly")
    line = _refused(capsys, [*argv[:-1], str(tmp_path / "notes.pt"), "--overwrite"], tmp_path)
    assert "is not an earlier weights file; --overwrite would replace notes.pt" in line, line


def test_train_never_replaces_the_users_config_in_its_log_dir(tmp_path):
    """`python train.py --config run/config.toml --log_dir run`: the user's config (with its comments) stays."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("# my settings, with comments\n[model]\nname = \"llama3\"\nflavor = \"debug\"\n"
                                     "[training]\nmax_steps = 1\nseq_len = 32\nbatch_size = 1\n")
    before = snapshot(tmp_path)
    result = subprocess.run([sys.executable, "train.py", "--config", str(run / "config.toml"), "--log_dir", str(run),
                             "--checkpoint_dir", str(tmp_path / "ckpt"), "--optimizer.lr", "1e-2"], cwd=REPO,
                            env=clean_env(), capture_output=True, text=True, timeout=240)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == (f"ConfigError: metrics.log_dir = {run} holds config.toml, which a training run did not write "
                        f"and would replace; move it away or pass --metrics.log_dir another folder, e.g. {run}/logs")
    assert snapshot(tmp_path) == before


def test_a_run_resumes_in_its_own_log_dir_until_the_user_edits_its_config_there(tmp_path, capsys, one_thread):
    train_tiny(tmp_path, steps=1)
    logs = tmp_path / "logs"
    assert (logs / ".titan-train.json").is_file()
    train_tiny(tmp_path, steps=2)  # the same command again: resumes, rewrites its config.toml, appends its metrics
    assert len((logs / "metrics.jsonl").read_text().splitlines()) >= 2
    with open(logs / "config.toml", "a") as f:
        f.write("# tried lr 1e-2 here, diverged\n")
    line = _refused(capsys, ["train", *tiny_args(tmp_path, training__max_steps=3)], tmp_path)
    assert "holds config.toml, which a training run did not write" in line, line


def test_the_log_dir_of_a_run_from_before_markers_is_still_the_runs(tmp_path, one_thread):
    train_tiny(tmp_path, steps=1)
    (tmp_path / "logs" / ".titan-train.json").unlink()  # as an earlier version left it: run_info.json says whose
    train_tiny(tmp_path, steps=2)


def test_a_runs_files_go_beside_unrelated_user_files_which_keep_their_bytes(world, tmp_path, capsys, one_thread):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("notes.txt", "train_v2.py"):
        (mine / name).write_text(USER_FILES[name])
    before = snapshot(mine)
    assert cli_main(["train", *tiny_args(tmp_path, metrics__log_dir=mine, checkpoint__dir=mine,
                                         training__max_steps=1, checkpoint__async_save=False)]) == 0
    assert cli_main(["report", str(mine), "--no-plots"]) == 0
    assert cli_main(["train-tokenizer", str(world / "corpus"), "--vocab-size", "300", "--output", str(mine)]) == 0
    after = snapshot(mine)
    assert {k: after[k] for k in before} == before
    assert {"step-1", "config.toml", "metrics.jsonl", "report.md", "tokenizer.json"} <= after.keys()


def test_the_names_outputs_py_recognises_are_those_the_writers_use():
    from titan_npu import outputs
    from titan_npu.checkpoint import storage
    from titan_npu.metrics.run_info import RUN_INFO
    from titan_npu.metrics.run_metrics import METRICS

    assert set(outputs.CHECKPOINT_FILES) == {storage.DCP_METADATA, storage.INFO_FILE}
    assert {storage.CONFIG_FILE, RUN_INFO, METRICS, "report.md", "report.png"} == set(outputs.RUN_LOG_FILES)

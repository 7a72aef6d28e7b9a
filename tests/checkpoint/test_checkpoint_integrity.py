"""A checkpoint whose files are not the ones it saved is found out by content (checkpoint.json records each file's size
and digest): `checkpoint.resume = auto` skips the damaged step for the previous intact one with a line naming it, a
step named by the user is refused in one line naming the file and the step to use, and nothing on disk changes.
Checkpoints saved before digests were recorded still load."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_run import snapshot, tiny_args, train_tiny

from titan_npu.checkpoint import storage
from titan_npu.cli import main as cli_main


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two real tiny runs of two steps (a checkpoint at each), with different seeds: their run folders."""
    root = tmp_path_factory.mktemp("runs")
    train_tiny(root / "a", steps=2, checkpoint__save_interval=1)
    train_tiny(root / "b", steps=2, checkpoint__save_interval=1, training__seed=7)
    return {"a": root / "a", "b": root / "b"}


def _copy_from(source: str) -> Callable[[Path, dict[str, Path]], None]:
    """Replace a file of step-2 by another checkpoint's file (`run/step/file`)."""
    run, step, rel = source.split("/", 2)

    def damage(step2: Path, runs: dict[str, Path]) -> None:
        shutil.copyfile(runs[run] / "ckpt" / step / rel, step2 / rel)
    return damage


def _rewrite_middle(rel: str) -> Callable[[Path, dict[str, Path]], None]:
    def damage(step2: Path, runs: dict[str, Path]) -> None:
        with open(step2 / rel, "r+b") as f:
            size = f.seek(0, 2)
            f.seek(size // 2)
            middle = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in middle))  # the same size, other bytes
    return damage


def _delete(rel: str) -> Callable[[Path, dict[str, Path]], None]:
    def damage(step2: Path, runs: dict[str, Path]) -> None:
        (step2 / rel).unlink()
    return damage


def _extra_rank_file(step2: Path, runs: dict[str, Path]) -> None:
    shutil.copyfile(step2 / "ranks" / "rank-0.pt", step2 / "ranks" / "rank-1.pt")


def _cut_info(step2: Path, runs: dict[str, Path]) -> None:
    info = step2 / storage.INFO_FILE
    info.write_bytes(info.read_bytes()[:120])


DAMAGE = {
    # what is damaged -> (how, a regex the refusal names it by)
    "rank-file-of-another-step": (_copy_from("a/step-1/ranks/rank-0.pt"), r"ranks/rank-0\.pt is not the file"),
    "data-file-of-another-run": (_copy_from("b/step-2/__0_0.distcp"), r"__0_0\.distcp is not the file"),
    "data-file-rewritten-at-the-same-size": (_rewrite_middle("__0_0.distcp"), r"__0_0\.distcp is not the file"),
    "rank-file-rewritten-at-the-same-size": (_rewrite_middle("ranks/rank-0.pt"), r"rank-0\.pt is not the file"),
    "rank-file-missing": (_delete("ranks/rank-0.pt"), r"ranks/rank-0\.pt is missing"),
    "extra-rank-file": (_extra_rank_file, r"ranks/rank-1\.pt is not part of this checkpoint"),
    "checkpoint-json-cut-short": (_cut_info, r"checkpoint\.json is unreadable, cut short or corrupt"),
}


def _damaged_run(tmp_path: Path, runs: dict[str, Path], case: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    DAMAGE[case][0](run / "ckpt" / "step-2", runs)
    return run


def _train(run: Path, capsys, *extra: str, steps: int = 2) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(["train", *tiny_args(run, training__max_steps=steps, checkpoint__async_save=False), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_step_named_by_the_user_is_refused_in_one_line_naming_the_intact_step(case, runs, tmp_path,
                                                                                        capsys):
    run = _damaged_run(tmp_path, runs, case)
    before = snapshot(run)
    rc, out, err = _train(run, capsys, "--checkpoint.resume", "2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("CheckpointError: ") and re.search(DAMAGE[case][1], lines[0]), lines[0]
    assert "step-2 is damaged: use the intact step 1 before it (train: --checkpoint.resume 1" in lines[0]
    assert snapshot(run) == before


@pytest.mark.parametrize("case", DAMAGE)
def test_resume_auto_skips_a_damaged_step_for_the_previous_intact_one_and_says_so(case, runs, tmp_path, capsys):
    run = _damaged_run(tmp_path, runs, case)
    rc, out, err = _train(run, capsys)
    assert rc == 0, err
    said = out + err
    skipped = re.search(r"checkpoint: skipping damaged step 2: (.*)", said)
    assert skipped and re.search(DAMAGE[case][1], skipped.group(1)), said
    assert "resuming from step 1, the newest intact checkpoint" in said
    assert re.search(r"checkpoint: loaded step 1 from \S+step-1", said), said
    assert storage.recorded_problem(run / "ckpt" / "step-2") is None  # the run saved its own step 2 again


def test_when_every_checkpoint_is_damaged_resume_auto_refuses_instead_of_starting_over(runs, tmp_path, capsys):
    run = _damaged_run(tmp_path, runs, "rank-file-missing")
    _rewrite_middle("__0_0.distcp")(run / "ckpt" / "step-1", runs)
    before = snapshot(run)
    rc, out, err = _train(run, capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(r"every checkpoint in \S+ is damaged \(step 2: \S+rank-0\.pt is missing; step 1: \S+distcp is "
                     r"not the file", err), err
    assert snapshot(run) == before


def test_export_refuses_a_damaged_step_naming_the_intact_one(runs, tmp_path, capsys):
    run = _damaged_run(tmp_path, runs, "rank-file-of-another-step")
    capsys.readouterr()
    rc = cli_main(["export", "--checkpoint", str(run / "ckpt" / "step-2"), "--output", str(tmp_path / "w.pt"),
                   "--format", "pt"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "use the intact step 1 before it" in err, err
    assert not (tmp_path / "w.pt").exists()


def test_a_checkpoint_saved_before_digests_were_recorded_still_resumes(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    for step in (1, 2):  # as an older titan-npu wrote them
        info_path = run / "ckpt" / f"step-{step}" / storage.INFO_FILE
        info = json.loads(info_path.read_text())
        del info[storage.FILES_KEY]
        info_path.write_text(json.dumps(info))
    rc, out, err = _train(run, capsys, steps=3)
    assert rc == 0, err
    assert re.search(r"checkpoint: loaded step 2 from", out + err) and "skipping" not in out + err


def test_a_checkpoint_saved_before_digests_missing_a_rank_file_is_refused(runs, tmp_path, capsys):
    run = _damaged_run(tmp_path, runs, "rank-file-missing")
    info_path = run / "ckpt" / "step-2" / storage.INFO_FILE
    info = json.loads(info_path.read_text())
    del info[storage.FILES_KEY]
    info_path.write_text(json.dumps(info))
    rc, out, err = _train(run, capsys, "--checkpoint.resume", "2")
    assert rc == 2 and "ranks/rank-0.pt is missing (the checkpoint was saved by 1 ranks)" in err, err


def test_checkpoint_json_records_every_file_but_itself_and_the_config_copy(runs):
    step2 = runs["a"] / "ckpt" / "step-2"
    files = storage.read_info(step2)[storage.FILES_KEY]
    assert set(files) == {".metadata", "__0_0.distcp", "ranks/rank-0.pt"}
    assert all(entry["digest"].startswith("sha256:") for entry in files.values())


def test_a_large_file_is_digested_by_blocks_spread_over_it(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "DIGEST_FULL_BYTES", 1000)
    monkeypatch.setattr(storage, "DIGEST_BLOCK_BYTES", 100)
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 40)
    first = storage.file_digest(big)
    assert first.startswith("sha256-sampled:")
    data = bytearray(big.read_bytes())
    data[-1] ^= 1  # the last block is always read
    big.write_bytes(bytes(data))
    assert storage.file_digest(big) != first


@pytest.mark.parametrize("folder, kind", [("/proc/titan-ckpt", "proc"), ("/sys/titan-ckpt", "sysfs")])
def test_a_checkpoint_dir_on_a_filesystem_that_cannot_hold_files_says_so(folder, kind, tmp_path, capsys):
    if not Path(folder).parent.is_dir():
        pytest.skip(f"no {Path(folder).parent} here")
    capsys.readouterr()
    rc = cli_main(["train", *tiny_args(tmp_path, training__max_steps=1), "--checkpoint.dir", folder])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"is on the {kind} filesystem, which the kernel makes up and which cannot hold files" in err
    assert "free space" not in err and "pass --checkpoint.dir a folder" in err

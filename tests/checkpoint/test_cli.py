"""`titan-npu export` / `titan-npu import`: one-line errors, nothing half-written, the latest checkpoint by default."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import pytest
import torch
from tiny_run import snapshot, tiny_args, train_tiny

from titan_npu.cli import main
from titan_npu.commands.export import parse_size

from .conftest import TINY, job_config, model_manager, random_model

ARGS = TINY["llama3-gqa"]


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_export_of_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    code, err = _run(capsys, "export", "--checkpoint", str(tmp_path / "nothing"), "--output", str(tmp_path / "x.pt"))
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("CheckpointError:") and "is not a checkpoint" in err
    assert not (tmp_path / "x.pt").exists()


def test_export_of_an_incomplete_checkpoint_says_so(tmp_path, capsys):
    (tmp_path / "ckpt" / "step-9.tmp").mkdir(parents=True)
    code, err = _run(capsys, "export", "--checkpoint", str(tmp_path / "ckpt"), "--step", "9",
                     "--output", str(tmp_path / "x.pt"))
    assert code == 2 and "step 9" in err and "is incomplete (its save did not finish)" in err


def test_export_takes_the_latest_checkpoint_and_refuses_to_overwrite_its_output(tmp_path, capsys):
    model = random_model(ARGS, seed=0)
    manager, *_ = model_manager(job_config(tmp_path), model, ARGS)
    manager.save(1)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    manager.save(2)
    out = tmp_path / "latest.pt"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(out), "--dtype", "fp32"]) == 0
    assert "exported step 2" in capsys.readouterr().out
    assert torch.equal(torch.load(out, weights_only=True)["norm.weight"], model.norm.weight)
    code, err = _run(capsys, "export", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(out))
    assert code == 2 and "already exists" in err and "--overwrite" in err


def test_export_default_dtype_is_the_checkpoint_export_dtype(tmp_path, capsys):
    manager, *_ = model_manager(job_config(tmp_path, export_dtype="bf16"), random_model(ARGS, seed=1), ARGS)
    manager.save(1)
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt" / "step-1"), "--output", str(tmp_path / "o.pt")]) == 0
    assert {v.dtype for v in torch.load(tmp_path / "o.pt", weights_only=True).values()} == {torch.bfloat16}


def test_import_of_a_missing_input_is_one_line(tmp_path, capsys):
    code, err = _run(capsys, "import", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o.pt"))
    assert code == 2 and len(err.splitlines()) == 1 and "does not exist" in err
    assert not (tmp_path / "o.pt").exists()


def test_import_of_a_step_checkpoint_writes_its_weights_and_prints_the_model_section(tmp_path, capsys):
    model = random_model(ARGS, seed=2)
    manager, *_ = model_manager(job_config(tmp_path), model, ARGS)
    manager.save(3)
    assert main(["import", "--input", str(tmp_path / "ckpt" / "step-3"), "--output", str(tmp_path / "w.pt")]) == 0
    out = capsys.readouterr().out
    assert "[model]" in out and "n_kv_heads = 2" in out and 'initial_load = "' in out
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1000", 1000)])
def test_shard_sizes_parse(text, size):
    assert parse_size(text) == size


def test_the_commands_are_wired_into_titan_npu(capsys):
    for command, option in (("export", "--max-shard-size"), ("import", "--input")):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0 and option in capsys.readouterr().out


def _tokenizer_json(path):
    """A small real tokenizers file (word level) at path."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_export_hf_puts_the_training_tokenizer_beside_the_weights(tmp_path, capsys):
    cfg = job_config(tmp_path)
    cfg.data.tokenizer = str(_tokenizer_json(tmp_path / "my-bpe.json"))
    manager, *_ = model_manager(cfg, random_model(ARGS, seed=2), ARGS)
    manager.save(1)
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--output", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "my-bpe.json").read_bytes()
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert tok("hello world")["input_ids"] == [1, 2]

    # Weights only on request; a tokenizer moved since training is a one-line error and nothing is written.
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--output",
                 str(tmp_path / "bare"), "--tokenizer", "none"]) == 0
    assert not list((tmp_path / "bare").glob("tokenizer*"))
    (tmp_path / "my-bpe.json").unlink()
    code, err = _run(capsys, "export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "hf",
                     "--output", str(tmp_path / "moved"))
    assert code == 2 and len(err.splitlines()) == 1 and "my-bpe.json does not exist" in err and "--tokenizer" in err
    assert not (tmp_path / "moved").exists()


def test_export_hf_of_a_byte_tokenizer_run_writes_weights_only(tmp_path):
    manager, *_ = model_manager(job_config(tmp_path), random_model(ARGS, seed=3), ARGS)
    manager.save(1)
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--output", str(out)]) == 0
    assert (out / "config.json").is_file() and not list(out.glob("tokenizer*"))


def test_tokenizer_files_of_a_directory_and_their_hugging_face_names(tmp_path):
    from titan_npu.checkpoint.export import _hf_tokenizer_name, tokenizer_files
    from titan_npu.errors import CheckpointError

    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json", "README.md"):
        (tmp_path / "tok" / name).write_text("x")
    assert [f.name for f in tokenizer_files(str(tmp_path / "tok"))] == ["tokenizer.model", "tokenizer_config.json"]
    assert tokenizer_files("byte") == [] and tokenizer_files("none") == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds none of"):
        tokenizer_files(str(tmp_path / "empty"))
    names = [_hf_tokenizer_name(tmp_path / n) for n in ("spm.model", "bpe.json", "tokenizer_config.json", "vocab.txt")]
    assert names == ["tokenizer.model", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]


# ---- outputs that would destroy what the user has: tested on the checkpoint of a real tiny run, by checksums.

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """checkpoint.dir of a real two-step run (step-1, step-2 inside), made once; tests copy it before touching it."""
    return train_tiny(tmp_path_factory.mktemp("trained"), steps=2, checkpoint__save_interval=1)


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the trained run's checkpoint.dir at tmp_path/ckpt."""
    shutil.copytree(trained, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("fmt", ["pt", "hf"])
@pytest.mark.parametrize("output, relation", [("ckpt/step-1", "is"), ("ckpt", "contains"), (".", "contains"),
                                              ("ckpt/step-1/model", "lies inside")])
def test_export_never_writes_over_or_into_its_checkpoint(run_copy, tmp_path, capsys, monkeypatch, fmt, output,
                                                         relation):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, err = _run(capsys, "export", "--checkpoint", "ckpt/step-1", "--output", output, "--format", fmt,
                     "--overwrite")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--output {output} {relation} the checkpoint" in err, err
    assert err.endswith("choose another path" if relation == "is" else "write to a path outside it"), err
    assert snapshot(tmp_path) == before


def test_export_overwrite_refuses_a_folder_that_is_not_an_earlier_export_and_names_its_files(run_copy, tmp_path,
                                                                                            capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a week of notes")
    (mine / "other-run").mkdir()
    before = snapshot(tmp_path)
    for fmt in ("hf", "pt"):
        code, err = _run(capsys, "export", "--checkpoint", str(run_copy), "--output", str(mine), "--format", fmt,
                         "--overwrite")
        assert code == 2 and len(err.splitlines()) == 1, err
    assert "is not an earlier export; --overwrite would delete notes.txt, other-run" in _run(
        capsys, "export", "--checkpoint", str(run_copy), "--output", str(mine), "--format", "hf", "--overwrite")[1]
    # Another checkpoint is no export either.
    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    before = snapshot(tmp_path)
    code, err = _run(capsys, "export", "--checkpoint", str(run_copy), "--output", str(other / "step-1"), "--format",
                     "hf", "--overwrite")
    assert code == 2 and f"is the checkpoint {other.resolve() / 'step-1'}; choose another path" in err
    assert snapshot(tmp_path) == before


def test_export_overwrite_replaces_an_earlier_export_but_not_files_added_to_it(run_copy, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run_copy), "--format", "hf", "--output", str(out)]) == 0
    assert main(["export", "--checkpoint", str(run_copy), "--format", "hf", "--output", str(out), "--overwrite",
                 "--dtype", "fp32"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left beside it
    (out / "README.md").write_text("model card")
    before = snapshot(tmp_path)
    code, err = _run(capsys, "export", "--checkpoint", str(run_copy), "--format", "hf", "--output", str(out),
                     "--overwrite")
    assert code == 2 and "holds files an earlier export did not write; --overwrite would delete README.md" in err
    assert snapshot(tmp_path) == before


def test_an_export_that_fails_to_take_an_earlier_exports_name_leaves_the_earlier_one(run_copy, tmp_path, monkeypatch,
                                                                                    capsys):
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run_copy), "--format", "hf", "--output", str(out)]) == 0
    before = snapshot(tmp_path)
    replace = os.replace

    def fail_the_move_into_place(src, dst):
        if str(dst) == str(out) and str(src).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_the_move_into_place)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run_copy), "--format", "hf", "--output", str(out), "--overwrite"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("OSError: No space left on device (ENOSPC): ") and "\n" not in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_exports_and_imports_honour_the_umask(run_copy, tmp_path, umask):
    old = os.umask(umask)
    try:
        assert main(["export", "--checkpoint", str(run_copy), "--format", "hf", "--output", str(tmp_path / "hf")]) == 0
        assert main(["export", "--checkpoint", str(run_copy), "--output", str(tmp_path / "w.pt")]) == 0
        assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "i.pt")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~umask
    for f in [*(tmp_path / "hf").iterdir(), tmp_path / "w.pt", tmp_path / "i.pt"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


@pytest.mark.parametrize("output", ["ckpt/step-1", "ckpt/step-1/w.pt", "ckpt"])
def test_import_never_writes_over_or_into_its_input(run_copy, tmp_path, capsys, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, err = _run(capsys, "import", "--input", "ckpt/step-1", "--output", output, "--overwrite")
    assert code == 2 and len(err.splitlines()) == 1 and f"--output {output} " in err and "the input ckpt/step-1" in err
    assert snapshot(tmp_path) == before


def _truncate(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


DAMAGES = {
    "truncated-distcp": ("step-2/__0_0.distcp", lambda f: _truncate(f, f.stat().st_size // 2),
                         r"__0_0.distcp is \d+ bytes but its index \(.metadata\) needs \d+ \(truncated"),
    "empty-distcp": ("step-2/__0_0.distcp", lambda f: _truncate(f, 0), r"__0_0.distcp is 0 bytes but its index"),
    "missing-distcp": ("step-2/__0_0.distcp", lambda f: f.unlink(), r"__0_0.distcp is missing"),
    "truncated-metadata": ("step-2/.metadata", lambda f: _truncate(f, 100), r"step-2/.metadata is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("command", ["export", "import", "generate"])
def test_a_damaged_checkpoint_file_is_one_line_naming_it_and_the_intact_step_before(run_copy, tmp_path, capsys,
                                                                                      damage, command):
    rel, spoil, problem = DAMAGES[damage]
    spoil(run_copy / rel)
    before = snapshot(tmp_path)
    step2 = str(run_copy / "step-2")
    argv = {"export": ["export", "--checkpoint", step2, "--output", str(tmp_path / "o.pt")],
            "import": ["import", "--input", step2, "--output", str(tmp_path / "o.pt")],
            "generate": ["generate", "--checkpoint", step2, "--max-new-tokens", "2"]}[command]
    code, err = _run(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("CheckpointError: ") and re.search(problem, err), err
    assert err.endswith(f"is damaged: use the intact step 1 before it (train: --checkpoint.resume 1; export, "
                        f"generate: --checkpoint {run_copy / 'step-1'})"), err
    assert snapshot(tmp_path) == before


def test_a_damaged_checkpoint_with_nothing_intact_before_it_says_so(run_copy, tmp_path, capsys):
    _truncate(run_copy / "step-1" / "__0_0.distcp", 10)
    code, err = _run(capsys, "export", "--checkpoint", str(run_copy / "step-1"), "--output", str(tmp_path / "o.pt"))
    assert code == 2 and err.endswith(f"no earlier intact checkpoint is in {run_copy}; start again or restore the "
                                      "files"), err


def test_training_a_run_that_already_reached_max_steps_says_there_is_nothing_to_train(run_copy, tmp_path, capsys):
    """The README's second CPU command run after its first: a silent exit would look like a broken install."""
    before = snapshot(run_copy)
    assert main(["train", *tiny_args(tmp_path, training__max_steps=1)]) == 0
    out = capsys.readouterr().out
    assert "[Step" not in out
    assert ("nothing to train: the run resumed at step 2 and training.max_steps is 1; raise --training.max_steps to "
            "continue it, or give another --checkpoint_dir to start a new run") in out, out
    assert snapshot(run_copy) == before


def test_import_help_names_every_model_type_the_registry_converts():
    from titan_npu.commands.import_weights import build_parser
    from titan_npu.models.registry import SPECS

    text = " ".join(build_parser().format_help().split())
    for spec in SPECS.values():
        for model_type in spec.hf.model_types:
            assert re.search(rf"\b{model_type}\b", text), (model_type, text)

"""A data mixture as the user writes it: [[data.sources]] in TOML, its YAML equivalent, Megatron's one-line
`--data_path 0.7 /data/web 0.3 /data/code`; the run's accounting on the console and in metrics.jsonl; and every bad
mixture refused in one line with exit code 2 before anything is written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import make_docs, write_jsonl
from tiny_run import snapshot, tiny_args

from titan_npu.cli import main as cli_main
from titan_npu.config.loader import config_to_dict, load_config, save_config
from titan_npu.config.mixture import sources_of
from titan_npu.config.schema import DataSource

REPO = Path(__file__).resolve().parents[2]


def corpus(d: Path, name: str, docs: int = 30, seed: int = 0) -> Path:
    path = d / f"{name}.txt"
    path.write_text("\n\n".join(make_docs(docs, seed)) + "\n", encoding="utf-8")
    return path


def test_toml_yaml_and_megatron_spellings_give_the_same_sources(tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text('[[data.sources]]\nname = "web"\npath = "/data/web"\nweight = 0.7\n\n'
                    '[[data.sources]]\npath = "/data/code.jsonl"\nweight = 0.3\ntext_field = "content"\n'
                    'max_epochs = 2\n')
    yaml = tmp_path / "mix.yaml"
    yaml.write_text("data:\n  sources:\n    - {name: web, path: /data/web, weight: 0.7}\n"
                    "    - {path: /data/code.jsonl, weight: 0.3, text_field: content, max_epochs: 2}\n")
    from_toml = load_config(toml, model=False).data.sources
    assert from_toml == load_config(yaml, model=False).data.sources
    assert from_toml[1] == DataSource(path="/data/code.jsonl", weight=0.3, text_field="content", max_epochs=2)
    megatron = ["0.7", "/data/web", "0.3", "/data/code.jsonl"]
    for argv in (["--data_path", *megatron], ["--data-path", " ".join(megatron)], ["--data.sources", *megatron],
                 [f"--data.sources={' '.join(megatron)}"]):
        sources = sources_of(load_config(None, argv, model=False).data)
        assert [(s.name, s.path, s.weight) for s in sources] == [("web", "/data/web", 0.7),
                                                                  ("code", "/data/code.jsonl", 0.3)], argv


def test_weights_are_normalised_and_names_default_from_the_path():
    cfg = load_config(None, ["--data_path", "3", "/d/web/", "1", "/d/books.jsonl.gz", "--training.max_steps", "2"],
                      model=False)
    assert [(s.name, s.weight, s.text_field) for s in sources_of(cfg.data)] == [("web", 0.75, "text"),
                                                                               ("books", 0.25, "text")]
    assert cfg.training.max_steps == 2  # the value list ends at the next --key


def test_data_path_alone_is_a_one_source_mixture_and_the_command_line_replaces_the_files_data(tmp_path):
    assert [(s.name, s.path, s.weight) for s in sources_of(load_config(None, ["--data.path", "/d/web"],
                                                                        model=False).data)] == [("web", "/d/web", 1.0)]
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('[data]\npath = "/d/single"\n')
    cfg = load_config(cfg_file, ["--data_path", "0.5", "/d/a", "0.5", "/d/b"], model=False)
    assert cfg.data.path == "" and len(cfg.data.sources) == 2
    cfg_file.write_text('[[data.sources]]\npath = "/d/a"\n')
    assert load_config(cfg_file, ["--data_dir", "/d/one"], model=False).data.sources == []


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_mixture_config_is_written_back_and_reads_the_same(tmp_path, suffix):
    cfg = load_config(None, ["--data_path", "0.7", "/d/web", "0.3", "/d/code"], model=False)
    save_config(cfg, tmp_path / f"run{suffix}")
    assert config_to_dict(load_config(tmp_path / f"run{suffix}", model=False))["data"] == config_to_dict(cfg)["data"]


def test_a_mixture_trains_and_accounts_for_each_source(tmp_path):
    sources = [corpus(tmp_path, n, seed=i) for i, n in enumerate(("web", "code", "math"))]
    proc = subprocess.run(
        [sys.executable, "train.py", *tiny_args(tmp_path, training__max_steps=5, metrics__tensorboard=True,
                                                metrics__report=True, data__val_fraction=0.2,
                                                validation__enable=True, validation__interval=5,
                                                validation__steps=1), "--data_path",
         *[x for w, p in zip(("0.6", "0.3", "0.1"), sources) for x in (w, str(p))]],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "mix=web 60%/code 30%/math 10%" in proc.stdout  # step 5: 10 windows, 6/3/1
    assert re.search(r"val_loss=[\d.]+, val_ppl=[\d.]+ \[web=[\d.]+, code=[\d.]+, math=[\d.]+\]", proc.stdout)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert {k: v for k, v in last.items() if k.startswith("tokens/")} == {"tokens/web": 192, "tokens/code": 96,
                                                                         "tokens/math": 32}
    assert last["share/web"] == pytest.approx(0.6) and sum(last["tokens/" + n] for n in ("web", "code", "math")) \
        == last["tokens_seen"]
    val = [r for r in records if "val_loss" in r][-1]
    assert {f"val_loss/{n}" for n in ("web", "code", "math")} <= val.keys()
    report = (tmp_path / "logs" / "report.md").read_text()
    assert "## Data mixture (step 5)" in report and "| web | 0.600 | 192 | 0.600 |" in report
    assert (tmp_path / "logs" / "report.png").stat().st_size > 0
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    events.Reload()
    assert {"tokens/web", "share/math", "val_loss/code"} <= set(events.Tags()["scalars"])


def test_a_recipe_mixes_a_saved_hf_dataset_prepared_shards_and_a_raw_jsonl_with_its_own_text_field(tmp_path,
                                                                                                    capsys):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": make_docs(30, 1)}).save_to_disk(str(tmp_path / "web"))
    assert cli_main(["prepare-data", str(corpus(tmp_path, "books", seed=2)), "--tokenizer", "byte", "--output",
                     str(tmp_path / "books_tok"), "--progress", "lines"]) == 0
    write_jsonl(tmp_path / "code.jsonl", [{"content": doc} for doc in make_docs(30, 3)])
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[[data.sources]]\nname = "web"\npath = "{tmp_path / "web"}"\nweight = 0.5\n\n'
                      f'[[data.sources]]\nname = "books"\npath = "{tmp_path / "books_tok"}"\nweight = 0.3\n\n'
                      f'[[data.sources]]\nname = "code"\npath = "{tmp_path / "code.jsonl"}"\nweight = 0.2\n'
                      'text_field = "content"\n')
    capsys.readouterr()
    assert cli_main(["train", "--config", str(recipe), *tiny_args(tmp_path, training__max_steps=5)]) == 0
    assert "mix=web 50%/books 30%/code 20%" in capsys.readouterr().out  # step 5: 10 windows, 5/3/2
    last = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    assert [last[f"tokens/{n}"] for n in ("web", "books", "code")] == [160, 96, 64]


def test_one_source_keeps_the_console_line_as_it_was(tmp_path, capsys):
    assert cli_main(["train", *tiny_args(tmp_path, training__max_steps=1)]) == 0
    assert "mix=" not in capsys.readouterr().out
    assert not [k for k in json.loads((tmp_path / "logs" / "metrics.jsonl").read_text()) if "/" in k]


def _prepared(d: Path, name: str, fingerprint: str | None = None) -> None:
    corpus(d, name + "_raw")
    assert cli_main(["prepare-data", str(d / f"{name}_raw.txt"), "--output", str(d / name), "--tokenizer",
                     "byte"]) == 0
    if fingerprint is not None:
        index = json.loads((d / name / "index.json").read_text())
        index["tokenizer"]["fingerprint"] = fingerprint
        (d / name / "index.json").write_text(json.dumps(index))


def _setup(kind: str):
    def setup(d: Path) -> None:
        corpus(d, "web")
        corpus(d, "code", seed=3)
        if kind == "empty":
            (d / "empty.txt").write_text("")
        if kind == "tiny":
            (d / "tiny.txt").write_text("hi\n")
        if kind == "field":
            write_jsonl(d / "body.jsonl", [{"body": doc} for doc in make_docs(20)])
        if kind == "tokenizer":
            _prepared(d, "other", fingerprint="0123456789abcdef")
        if kind == "dup-toml":
            (d / "mix.toml").write_text(f'[[data.sources]]\nname = "web"\npath = "{d}/web.txt"\n\n'
                                        f'[[data.sources]]\nname = "web"\npath = "{d}/code.txt"\n')
        if kind == "both":
            (d / "mix.toml").write_text(f'[data]\npath = "{d}/web.txt"\n\n[[data.sources]]\npath = "{d}/code.txt"\n')
        if kind == "neg":
            (d / "mix.toml").write_text(f'[[data.sources]]\npath = "{d}/web.txt"\nmax_epochs = -1\n')
        if kind == "unknown-key":
            (d / "mix.toml").write_text(f'[[data.sources]]\npath = "{d}/web.txt"\nwieght = 2\n')
    return setup


# (id, mixture arguments, setup, the error's class, a regex of its message)
CASES = [
    ("negative-weight", ["--data_path", "-0.5 {d}/web.txt 1 {d}/code.txt"], None, "ConfigError",
     r"data.sources\[0\].weight = -0.5 must be a finite number >= 0"),
    ("nan-weight", ["--data_path", "nan {d}/web.txt 1 {d}/code.txt"], None, "ConfigError",
     r"data_path\[0\].weight = 'nan' is not a finite number"),
    ("inf-weight", ["--data_path", "inf {d}/web.txt 1 {d}/code.txt"], None, "ConfigError",
     r"'inf' is not a finite number"),
    ("all-zero-weights", ["--data_path", "0 {d}/web.txt 0 {d}/code.txt"], None, "ConfigError",
     r"every weight is 0; give at least one source a weight > 0"),
    ("duplicate-default-name", ["--data_path", "0.5 {d}/web.txt 0.5 {d}/sub/web.txt"], None, "ConfigError",
     r"data.sources\[0\] and data.sources\[1\] are both named 'web'; give each source its own name"),
    ("duplicate-name", ["--config", "{d}/mix.toml"], "dup-toml", "ConfigError", r"both named 'web'"),
    ("path-and-sources", ["--config", "{d}/mix.toml"], "both", "ConfigError",
     r"data.path = .* and data.sources are both set"),
    ("unknown-source-key", ["--config", "{d}/mix.toml"], "unknown-key", "ConfigError",
     r"data.sources\[0\]: unknown key 'wieght' \(use name, path, weight, text_field, max_epochs\)"),
    ("negative-max-epochs", ["--config", "{d}/mix.toml"], "neg", "ConfigError",
     r"data.sources\[0\].max_epochs = -1 must be >= 0"),
    ("odd-megatron", ["--data_path", "0.7 {d}/web.txt 0.3"], None, "ConfigError",
     r"has 3 items, not weight/path pairs; write 'WEIGHT PATH WEIGHT PATH"),
    ("paths-without-weights", ["--data_path", "{d}/web.txt {d}/code.txt"], None, "ConfigError",
     r"stands where a weight belongs"),
    ("two-weights", ["--data_path", "0.5 0.5"], None, "ConfigError", r"'0.5' stands where a path belongs"),
    ("missing-source", ["--data_path", "0.5 {d}/web.txt 0.5 {d}/nowhere"], None, "DataError",
     r"data source 'nowhere' \(data.sources\[1\]\): data path .*nowhere does not exist"),
    ("empty-source", ["--data_path", "0.5 {d}/web.txt 0.5 {d}/empty.txt"], "empty", "DataError",
     r"data source 'empty' .*holds no documents"),
    ("too-small-source", ["--data_path", "0.5 {d}/web.txt 0.5 {d}/tiny.txt"], "tiny", "DataError",
     r"data source 'tiny' .* fewer than one window of seq_len\+1 = 33"),
    ("text-field-absent", ["--data_path", "0.5 {d}/web.txt 0.5 {d}/body.jsonl"], "field", "DataError",
     r"data source 'body' .*no 'text' field"),
    ("tokenizer-mismatch", ["--data_path", "0.5 {d}/web.txt 0.5 {d}/other"], "tokenizer", "DataError",
     r"data source 'other' .*tokenised with a different tokenizer"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_bad_mixture_is_refused_in_one_line_before_anything_is_written(case, tmp_path, capsys):
    case_id, args, kind, error, message = case
    d = tmp_path / "case"
    d.mkdir()
    _setup(kind or "")(d)
    before = snapshot(d)
    capsys.readouterr()
    rc = cli_main(["train", *tiny_args(d, training__max_steps=1), *[a.replace("{d}", str(d)) for a in args]])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    kind_, _, text = lines[0].partition(": ")
    assert kind_ == error, lines[0]
    assert re.search(message, text), text
    assert snapshot(d) == before


@pytest.mark.parametrize("case_id", ["odd-megatron", "tokenizer-mismatch"])
def test_a_bad_mixture_exits_2_with_one_line_in_a_real_process(case_id, tmp_path):
    _, args, kind, error, message = next(c for c in CASES if c[0] == case_id)
    _setup(kind or "")(tmp_path)
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "train.py", *tiny_args(tmp_path),
                           *[a.replace("{d}", str(tmp_path)) for a in args]],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"{error}: "), proc.stderr
    assert re.search(message, proc.stderr)
    assert snapshot(tmp_path) == before

"""Hugging Face datasets on local disk as inputs (titan_npu/data/hf_datasets.py): a save_to_disk folder, or a dataset
in the local HF cache by name (hf://namespace/name[/subset][?split=...]), read through the `datasets` library offline.

The datasets here are written by the library itself: Dataset / DatasetDict.save_to_disk, and a datasets-cache entry
prepared by its json builder under the name load_dataset(name) looks up offline. The hub-cache snapshot (what
`hf download` leaves) is laid out as huggingface_hub's cache is: refs/main naming a snapshot folder.
Reading a name runs in real processes (`titan-npu prepare-data`, `python train.py`) with HF_HOME pointed at a tmp
cache, since the HF libraries read their cache location once, at import.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")

from tiny_run import snapshot, tiny_args  # noqa: E402

from titan_npu.cli import main as cli_main  # noqa: E402
from titan_npu.data import build_tokenizer  # noqa: E402
from titan_npu.data.datasets import open_dataset, read_index  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"text": f"document {i}: " + "some words of a tiny corpus " * (3 + i % 5), "id": i} for i in range(120)]
SNAPSHOT_SHA = "0123456789abcdef0123456789abcdef01234567"


def _build(root: Path) -> None:
    """root/one (a Dataset), root/dict (train + test), root/no_train (a + b), root/hf: demo/cached (datasets cache,
    train + validation), demo/snap (hub cache: jsonl files of splits train and test) and demo/partial (the same,
    downloaded in part)."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(root / "one"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(10))}).save_to_disk(str(root / "dict"))
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(root / "no_train"))
    src = root / "src"
    src.mkdir()
    for split, rows in (("train", ROWS), ("validation", ROWS[:30])):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # What load_dataset("demo/cached") prepares online: <cache>/demo___cached/default/0.0.0/<commit>/. The builder
    # only writes a namespaced folder for Hub data files, so it writes under the bare name and the folder is renamed.
    stage = root / "stage"
    Json(cache_dir=str(stage), dataset_name="cached", config_name="default", config_id="default", hash=SNAPSHOT_SHA,
         data_files={"train": str(src / "train.jsonl"), "validation": str(src / "validation.jsonl")}
         ).download_and_prepare()
    (root / "hf" / "datasets").mkdir(parents=True)
    shutil.move(stage / "cached", root / "hf" / "datasets" / "demo___cached")
    shutil.rmtree(stage)
    for p in (root / "hf" / "datasets").rglob("*.lock"):
        p.unlink()
    repo = root / "hf" / "hub" / "datasets--demo--snap"
    data = repo / "snapshots" / SNAPSHOT_SHA / "data"
    data.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT_SHA)
    shutil.copy(src / "train.jsonl", data / "train-00000-of-00001.jsonl")
    (data / "test-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:20]))
    # demo/partial: downloaded with --include, so its cached tree listing names a file that is not there.
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    partial = root / "hf" / "hub" / "datasets--demo--partial"
    shutil.copytree(repo, partial, symlinks=True)
    write_tree_cache(str(partial), SNAPSHOT_SHA, {
        "data/train-00000-of-00001.jsonl": TreeCacheEntry(size=1, blob_id="1" * 40),
        "other/big-00000-of-00009.parquet": TreeCacheEntry(size=1, blob_id="2" * 40)})


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_data")
    _build(root)
    return root


def _env(root: Path) -> dict[str, str]:
    """A user's environment with the HF cache at root/hf and a Hub that cannot be reached (nothing is fetched)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(root / "hf"), HF_ENDPOINT="http://127.0.0.1:9", TITAN_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    return env


def _titan(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_npu.cli", *args], cwd=root, env=_env(root),
                          capture_output=True, text=True, timeout=timeout)


def _train(root: Path, run: Path, data_path: str, *extra: str) -> subprocess.CompletedProcess:
    args = tiny_args(run, training__max_steps=2, checkpoint__enable=False, data__path=data_path)
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args, *extra], cwd=root, env=_env(root),
                          capture_output=True, text=True, timeout=240)


def _contents(folder: Path) -> dict[str, str]:
    """snapshot(folder) less the empty lock files the datasets library leaves in its cache when it opens an entry."""
    return {k: v for k, v in snapshot(folder).items() if not k.endswith(".lock")}


def _docs(path: str, **kw: str) -> list[list[int]]:
    ds = open_dataset(path, build_tokenizer("byte"), **kw)
    return [ds.read(i, 0, int(n)).tolist() for i, n in enumerate(ds.doc_lengths)]


def test_a_save_to_disk_dataset_and_dataset_dict_prepare_and_train(hf_data, tmp_path):
    byte = build_tokenizer("byte")
    expected = [byte.encode_flat([r["text"]], bos=True, eos=True)[0].tolist() for r in ROWS]
    # data.path: a Dataset folder, a DatasetDict folder (its train split) and one split's folder read the rows.
    assert _docs(str(hf_data / "one")) == expected
    assert _docs(str(hf_data / "dict")) == expected
    assert _docs(str(hf_data / "dict" / "test")) == expected[:10]
    assert _docs(str(hf_data / "dict"), split="test") == expected[:10]  # a mixture source's split key
    before = snapshot(hf_data)
    for name in ("one", "dict"):
        out = tmp_path / f"prepared_{name}"
        assert cli_main(["prepare-data", str(hf_data / name), "-o", str(out), "--progress", "lines"]) == 0
        assert read_index(out)["num_documents"] == len(ROWS)
        assert cli_main(["prepare-data", str(hf_data / name), "-o", str(out)]) == 0  # up to date: a no-op
        assert _docs(str(out)) == expected
    assert snapshot(hf_data) == before  # reading wrote nothing beside the datasets
    run = tmp_path / "run"
    assert cli_main(["train", *tiny_args(run, training__max_steps=2, checkpoint__enable=False,
                                         data__path=str(tmp_path / "prepared_dict"))]) == 0
    assert cli_main(["train", *tiny_args(tmp_path / "run_raw", training__max_steps=2, checkpoint__enable=False,
                                         data__path=str(hf_data / "dict"))]) == 0
    steps = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r][-1] == 2


def test_a_folder_searched_for_inputs_reads_a_save_to_disk_dataset_inside_it(hf_data, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("a note of its own\n")
    shutil.copytree(hf_data / "one", corpus / "web")
    out = tmp_path / "out"
    assert cli_main(["prepare-data", str(corpus), "-o", str(out)]) == 0
    assert read_index(out)["num_documents"] == 1 + len(ROWS)


def test_a_dataset_in_the_hf_cache_is_read_by_name_offline(hf_data, tmp_path):
    before = _contents(hf_data / "hf")
    byte = build_tokenizer("byte")
    for spec, rows in (("hf://demo/cached?split=validation", ROWS[:30]), ("hf://demo/cached", ROWS),
                       ("hf://demo/snap", ROWS), ("hf://datasets/demo/snap?split=test", ROWS[:20])):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        r = _titan(hf_data, "prepare-data", spec, "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert read_index(out)["num_documents"] == len(rows)
        assert _docs(str(out)) == [byte.encode_flat([x["text"]], bos=True, eos=True)[0].tolist() for x in rows]
    r = _titan(hf_data, "prepare-data", "hf://demo/partial", "-o", str(tmp_path / "partial"))
    assert r.returncode == 0 and read_index(tmp_path / "partial")["num_documents"] == len(ROWS), r.stderr
    assert "warning: hf://demo/partial: the cached snapshot" in r.stderr and "holds only part" in r.stderr
    r = _train(hf_data, tmp_path / "run", "hf://demo/cached")
    assert r.returncode == 0, r.stderr
    assert "[Step 2]" in r.stdout + r.stderr
    assert _contents(hf_data / "hf") == before  # nothing fetched, nothing prepared or converted in the cache


def _not_a_dataset(root: Path) -> Path:
    bad = root / "not_a_dataset"
    shutil.copytree(root / "one", bad)
    (bad / "state.json").write_text("{ this is not json")
    return bad


def _no_state(root: Path) -> Path:
    bad = root / "no_state"
    shutil.copytree(root / "one", bad)
    (bad / "state.json").unlink()
    return bad


def _truncated(root: Path) -> Path:
    bad = root / "truncated"
    shutil.copytree(root / "one", bad)
    arrow = next(bad.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])  # a copy that stopped half-way
    return bad


BAD = [  # (id, input, extra prepare-data args, a regex the one line matches)
    ("name_not_on_disk", "hf://demo/absent", [],
     r"DataError: Hugging Face dataset demo/absent is not on this machine .*hf download demo/absent --repo-type "
     r"dataset \(huggingface-cli download, its older name\).*HF_HUB_OFFLINE=1"),
    ("split_absent_in_cache", "hf://demo/cached?split=nope", [],
     r"has no split 'nope' \(splits: train, validation\)"),
    ("split_absent_in_hub_snapshot", "hf://demo/snap?split=validation", [],
     r"has no split 'validation' \(splits: train, test\)"),
    ("several_splits_none_train", "{root}/no_train", [], r"several splits and none is 'train' \(a, b\)"),
    ("subset_absent", "hf://demo/cached/nosuch", [], r"hf://demo/cached/nosuch: .*nosuch.*default"),
    ("text_field_absent_saved", "{root}/dict", ["--text-field", "body"],
     r"no 'body' column \(columns: text, id\); set --text-field"),
    ("text_field_absent_by_name", "hf://demo/snap", ["--text-field", "body"], r"no 'body' column .*text.*id"),
    ("folder_not_a_dataset", "{root}/not_a_dataset", [],
     r"looks like a Hugging Face save_to_disk folder but cannot be loaded"),
    ("folder_without_state", "{root}/no_state", [], r"is not a save_to_disk folder \(no state.json"),
    ("arrow_truncated", "{root}/truncated", [], r"truncated looks like a Hugging Face save_to_disk folder but cannot "
     r"be loaded \(.*\); save it again"),
    ("text_not_a_string", "{root}/one", ["--text-field", "id"], r"one:row 1: empty or non-string 'id'"),
    ("hf_url_of_a_path", "hf:///data/web", [], r"is not a dataset name in the HF cache"),
    ("invalid_name", "hf://a b/c", [], r"'a b' is not a valid Hugging Face dataset name"),
    ("unknown_option", "hf://demo/cached?splt=train", [], r"unknown option 'splt'"),
]


@pytest.fixture(scope="module")
def bad_data(hf_data) -> Path:
    _not_a_dataset(hf_data)
    _no_state(hf_data)
    _truncated(hf_data)
    return hf_data


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_hf_input_is_refused_in_one_line_and_nothing_is_written(case, bad_data, tmp_path):
    _, spec, extra, message = case
    spec = spec.format(root=bad_data)
    before = _contents(bad_data)
    r = _titan(bad_data, "prepare-data", spec, "-o", str(tmp_path / "out"), *extra)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("DataError: ") and re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists() and _contents(bad_data) == before


@pytest.mark.parametrize("case", [BAD[0], BAD[5]], ids=["name_not_on_disk", "text_field_absent"])
def test_a_training_run_refuses_a_bad_hf_data_path_in_one_line(case, bad_data, tmp_path):
    _, spec, extra, message = case
    extra = ["--data.text_field", extra[1]] if extra else []
    r = _train(bad_data, tmp_path / "run", spec.format(root=bad_data), *extra)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "run").exists()


def test_without_the_datasets_package_an_hf_input_is_refused_naming_the_extra(hf_data, tmp_path):
    code = ("import sys; sys.modules['datasets'] = None\n"  # the package absent, as on an install without [hf]
            "from titan_npu.cli import main\n"
            f"sys.exit(main(['prepare-data', {str(hf_data / 'one')!r}, '-o', {str(tmp_path / 'out')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(hf_data), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "DataError: reading a Hugging Face dataset needs the 'datasets' package; pip install 'titan-npu[hf]' "
        "(datasets==5.2.0)"], r.stderr
    assert not (tmp_path / "out").exists()


def test_the_hf_spelling_names_repo_subset_and_split_in_the_path_or_as_keys():
    from titan_npu.data.hf_datasets import parse_hf
    from titan_npu.errors import DataError

    def fields(spec: str, **kw: str) -> tuple[str, str, str]:
        src = parse_hf(spec, **kw)
        return src.name, src.subset, src.split

    assert fields("hf://HuggingFaceFW/fineweb-edu") == ("HuggingFaceFW/fineweb-edu", "", "")
    assert fields("hf://HuggingFaceFW/fineweb-edu/sample-10BT?split=train") == \
        ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")
    assert fields("hf://datasets/HuggingFaceFW/fineweb-edu?subset=sample-10BT") == \
        ("HuggingFaceFW/fineweb-edu", "sample-10BT", "")
    assert fields("hf://HuggingFaceFW/fineweb-edu", subset="sample-10BT", split="train") == \
        ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")  # a [[data.sources]] entry's subset / split keys
    for spec, kw, message in (("hf://a/b?split=train", {"split": "test"}, "says split train but split = 'test'"),
                              ("hf://a/b/c?subset=d", {}, "names two subsets"),
                              ("hf://a/b/c/d", {}, "is not a dataset name"),
                              ("hf://", {}, "is not a dataset name"),
                              ("hf://a/b?split", {}, "cannot read the options")):
        with pytest.raises(DataError, match=re.escape(message)):
            parse_hf(spec, **kw)

"""prepare-data: exact round trip, parallel = serial, idempotent, atomic, resumable, and its refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from data_helpers import make_docs, write_jsonl

import titan_npu.data.prepare as prepare_mod
from titan_npu.cli import main as cli_main
from titan_npu.data import build_tokenizer
from titan_npu.data.datasets import ShardDataset, open_dataset, read_index
from titan_npu.data.prepare import prepare, token_dtype
from titan_npu.errors import ConfigError, DataError


def _stream(folder) -> np.ndarray:
    index = read_index(folder)
    return np.concatenate([np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"]])


def _expected(docs: list[str], spec: str = "byte") -> np.ndarray:
    tok = build_tokenizer(spec)
    return np.concatenate([tok.encode(d, bos=True, eos=True) for d in docs])


def test_text_to_shards_reproduces_the_token_stream_exactly(corpus_txt, tmp_path):
    result = prepare([str(corpus_txt)], tmp_path / "out", shard_size=300)
    docs = corpus_txt.read_text().split("\n\n")
    assert np.array_equal(_stream(tmp_path / "out"), _expected([d.strip() for d in docs]))
    index = read_index(tmp_path / "out")
    assert index["dtype"] == "uint16" and index["num_documents"] == 40 == result.num_documents
    assert index["max_token_id"] == 257 and index["tokenizer"]["fingerprint"] == build_tokenizer("byte").fingerprint()
    assert index["sources"][0]["size"] == corpus_txt.stat().st_size
    assert len(index["shards"]) == result.num_shards > 1
    # Document boundaries: every document starts with BOS and ends with EOS inside one shard.
    ds = ShardDataset(tmp_path / "out", index)
    for doc in range(ds.num_docs):
        tokens = ds.read(doc, 0, int(ds.doc_lengths[doc]))
        assert tokens[0] == 256 and tokens[-1] == 257 and 257 not in tokens[:-1]


def test_two_workers_write_the_same_bytes_as_one(corpus_txt, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 500)  # many tasks, so order across processes matters
    prepare([str(corpus_txt)], tmp_path / "one", workers=1, shard_size=700)
    prepare([str(corpus_txt)], tmp_path / "two", workers=2, shard_size=700)
    index = read_index(tmp_path / "one")
    for s in index["shards"]:
        assert (tmp_path / "one" / s["file"]).read_bytes() == (tmp_path / "two" / s["file"]).read_bytes()
    assert index["shards"] == read_index(tmp_path / "two")["shards"]


def test_rerun_on_the_same_input_is_up_to_date(corpus_txt, tmp_path, capsys):
    args = ["prepare-data", str(corpus_txt), "--output", str(tmp_path / "out")]
    assert cli_main(args) == 0
    assert "wrote 40 documents" in capsys.readouterr().out
    mtime = (tmp_path / "out" / "index.json").stat().st_mtime_ns
    assert cli_main(args) == 0
    assert "is up to date (40 documents" in capsys.readouterr().out
    assert (tmp_path / "out" / "index.json").stat().st_mtime_ns == mtime


def test_changed_input_into_a_finished_output_is_refused(corpus_txt, tmp_path):
    prepare([str(corpus_txt)], tmp_path / "out")
    corpus_txt.write_text("different\n")
    with pytest.raises(DataError, match="already holds data prepared from other inputs or settings"):
        prepare([str(corpus_txt)], tmp_path / "out")


def test_interrupted_run_leaves_no_complete_looking_shard_and_resumes_to_the_same_output(corpus_txt, tmp_path,
                                                                                          monkeypatch):
    prepare([str(corpus_txt)], tmp_path / "clean", shard_size=200)
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 300)
    calls = []
    original = prepare_mod._ShardWriter.add

    def add_then_interrupt(self, tokens, lengths):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        original(self, tokens, lengths)

    monkeypatch.setattr(prepare_mod._ShardWriter, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus_txt)], tmp_path / "out", shard_size=200)
    out = tmp_path / "out"
    assert not (out / "index.json").exists() and not list(out.glob("*.tmp"))
    finished = json.loads((out / ".progress.json").read_text())["shards"]
    assert 0 < len(finished) and sorted(p.name for p in out.glob("shard_*.bin")) == [s["file"] for s in finished]
    with pytest.raises(DataError, match="unfinished prepare-data output; re-run the same prepare-data"):
        open_dataset(str(out), build_tokenizer("byte"))

    monkeypatch.setattr(prepare_mod._ShardWriter, "add", original)
    result = prepare([str(corpus_txt)], out, shard_size=200)
    assert result.resumed_docs == sum(s["num_docs"] for s in finished) > 0
    assert not (out / ".progress.json").exists()
    assert np.array_equal(_stream(out), _stream(tmp_path / "clean"))
    assert read_index(out)["shards"] == read_index(tmp_path / "clean")["shards"]


def test_unfinished_output_of_other_inputs_is_refused(corpus_txt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".progress.json").write_text(json.dumps({"settings": {}, "sources": [], "shards": []}))
    with pytest.raises(DataError, match="holds an unfinished run of other inputs or settings"):
        prepare([str(corpus_txt)], out)


def test_non_empty_foreign_output_folder_is_refused(corpus_txt, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.md").write_text("mine")
    with pytest.raises(DataError, match="is not empty and not a prepare-data output"):
        prepare([str(corpus_txt)], tmp_path / "out")


def test_bad_record_stops_the_run_and_leaves_nothing_behind(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in make_docs(30)])
    with open(path, "a") as f:
        f.write("{oops\n")
    with pytest.raises(DataError, match=r"in.jsonl:31: malformed JSON .*or pass --skip-bad-records"):
        prepare([str(path)], tmp_path / "out", shard_size=50)
    assert not (tmp_path / "out").exists()


def test_skip_bad_records_reports_the_count_at_the_end(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "one"}, {"text": ""}, {"text": "two"}])
    code = cli_main(["prepare-data", str(path), "-o", str(tmp_path / "out"), "--skip-bad-records"])
    assert code == 0
    assert "skipped 1 bad record(s); first: " in capsys.readouterr().err
    assert read_index(tmp_path / "out")["bad_records_skipped"] == 1
    assert read_index(tmp_path / "out")["num_documents"] == 2


def test_empty_input_is_refused_and_leaves_nothing_behind(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    assert cli_main(["prepare-data", str(tmp_path / "empty.txt"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("DataError: no documents found in") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_jsonl_format_writes_the_guides_tokens_lines_with_truncation(corpus_txt, tmp_path):
    prepare([str(corpus_txt)], tmp_path / "out", fmt="jsonl", max_seq_len=20)
    lines = [json.loads(line) for line in (tmp_path / "out" / "tokens.jsonl").read_text().splitlines()]
    tok = build_tokenizer("byte")
    first = corpus_txt.read_text().split("\n\n")[0]
    assert len(lines) == 40
    assert lines[0] == {"tokens": tok.encode(first, bos=True, eos=True)[:20], "length": 20}
    assert all(rec["length"] == len(rec["tokens"]) <= 20 for rec in lines)
    assert read_index(tmp_path / "out")["kind"] == "jsonl"


def test_vocab_above_65536_ids_is_stored_as_uint32():
    assert token_dtype(258) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32


def test_max_seq_len_with_bin_format_is_a_usage_error(corpus_txt, tmp_path, capsys):
    assert cli_main(["prepare-data", str(corpus_txt), "-o", str(tmp_path / "out"), "--max-seq-len", "8"]) == 2
    assert "--max-seq-len truncates documents of --format jsonl only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- outputs that would change the inputs, our own outputs read as input, leftovers of a refused run

def _checksums(folder) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("output, relation", [("corpus", "is"), ("corpus/tokens", "lies inside"),
                                              ("corpus/a.txt", "is"), (".", "holds")])
def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused(tmp_path, capsys, monkeypatch, output, relation):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("\n\n".join(make_docs(5)))
    before = _checksums(tmp_path)
    source = "corpus/a.txt" if output.endswith(".txt") else "corpus"
    assert cli_main(["prepare-data", source, "--output", output]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"DataError: --output {output} {relation} the input corpus") and len(err.splitlines()) == 1
    assert err.endswith("; write to a folder outside the inputs"), err
    assert _checksums(tmp_path) == before


def test_an_earlier_output_inside_an_input_folder_is_not_read_as_corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("\n\n".join(make_docs(5)))
    prepare([str(tmp_path / "corpus")], tmp_path / "corpus-tokens", fmt="jsonl")
    shutil.move(tmp_path / "corpus-tokens", tmp_path / "corpus" / "old-tokens")  # index.json + tokens.jsonl inside
    result = prepare([str(tmp_path / "corpus")], tmp_path / "again", fmt="jsonl")
    assert result.num_documents == 5
    assert [s["path"] for s in read_index(tmp_path / "again")["sources"]] == [str((tmp_path / "corpus" / "a.txt")
                                                                                  .resolve())]


@pytest.mark.parametrize("named", ["out", "out/index.json", "out/tokens.jsonl"])
def test_naming_a_prepare_data_output_as_input_is_refused(tmp_path, named):
    (tmp_path / "a.txt").write_text("\n\n".join(make_docs(5)))
    prepare([str(tmp_path / "a.txt")], tmp_path / "out", fmt="jsonl")
    with pytest.raises(DataError, match=rf"input {tmp_path / named} is a prepare-data output \({tmp_path / 'out'}\), "
                                        "not a corpus; give the raw files"):
        prepare([str(tmp_path / named)], tmp_path / "again")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("flag, value, bound", [("--workers", "0", "1"), ("--shard-size", "0", "1"),
                                                ("--max-seq-len", "-1", "0")])
def test_a_count_out_of_range_names_the_flag_and_value(tmp_path, capsys, flag, value, bound):
    with pytest.raises(ConfigError, match=f"^{flag} = {value} must be >= {bound} "):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", **{flag[2:].replace("-", "_"): int(value)})
    (tmp_path / "a.txt").write_text("\n\n".join(make_docs(5)))
    extra = ["--format", "jsonl"] if flag == "--max-seq-len" else []
    assert cli_main(["prepare-data", str(tmp_path / "a.txt"), "-o", str(tmp_path / "out"), flag, value, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ConfigError: {flag} = {value} must be >= {bound}"), err
    assert not (tmp_path / "out").exists()


def test_a_refused_run_removes_the_parent_folders_it_created(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    assert cli_main(["prepare-data", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "new" / "deep" / "out")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_corpus_folder_holding_another_tools_index_json_is_still_a_corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("\n\n".join(make_docs(5)))
    (tmp_path / "corpus" / "index.json").write_text('{"pages": [1, 2]}')  # a site generator's, say
    result = prepare([str(tmp_path / "corpus" / "a.txt")], tmp_path / "out")
    assert result.num_documents == 5

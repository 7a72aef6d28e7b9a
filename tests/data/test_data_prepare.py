"""prepare-data: exact round trip, parallel = serial, idempotent, atomic, resumable, and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import make_docs, write_jsonl

import titan_npu.data.prepare as prepare_mod
from titan_npu.cli import main as cli_main
from titan_npu.data import build_tokenizer
from titan_npu.data.datasets import ShardDataset, open_dataset, read_index
from titan_npu.data.prepare import prepare, token_dtype
from titan_npu.errors import DataError


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


def test_max_seq_len_with_bin_format_is_a_usage_error(corpus_txt, tmp_path):
    with pytest.raises(SystemExit):
        cli_main(["prepare-data", str(corpus_txt), "-o", str(tmp_path / "out"), "--max-seq-len", "8"])

"""Raw corpus reading: formats, compression, document separation and the message of each bad input."""

from __future__ import annotations

import gzip
import json

import pytest
from data_helpers import write_jsonl

from titan_npu.data.sources import BadRecords, DocumentReader, builtin_corpus_path, discover_inputs, iter_documents
from titan_npu.errors import DataError


def test_txt_documents_are_blank_line_blocks_or_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one\ntwo\n\n\nthree\r\n\n", encoding="utf-8")
    assert list(DocumentReader(path)) == ["one\ntwo", "three"]
    assert list(DocumentReader(path, doc_sep="line")) == ["one", "two", "three"]


def test_jsonl_reads_the_configured_text_field(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "body": "first"}, {"text": "y", "body": "second"}])
    assert list(DocumentReader(path)) == ["x", "y"]
    assert list(DocumentReader(path, text_field="body")) == ["first", "second"]


def test_json_array_and_compressed_inputs_read_like_plain_ones(tmp_path):
    records = [{"text": "alpha"}, {"text": "beta"}]
    (tmp_path / "a.json").write_text(json.dumps(records))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    assert list(DocumentReader(tmp_path / "a.json")) == ["alpha", "beta"]
    assert list(DocumentReader(tmp_path / "b.jsonl.gz")) == ["alpha", "beta"]


def test_zstd_input_reads_like_plain(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"p1\n\np2\n"))
    assert list(DocumentReader(tmp_path / "c.txt.zst")) == ["p1", "p2"]


def test_parquet_text_column_and_missing_column_message(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b", "c d"], "id": [1, 2]}), tmp_path / "d.parquet", row_group_size=1)
    assert list(DocumentReader(tmp_path / "d.parquet")) == ["a b", "c d"]
    with pytest.raises(DataError, match=r"no 'content' column \(columns: text, id\); set --text-field"):
        list(DocumentReader(tmp_path / "d.parquet", text_field="content"))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "broken\n{"text": "fine"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        list(DocumentReader(path))


def test_skip_bad_records_counts_them_and_keeps_the_rest(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\nnot json\n{"text": ""}\n{"other": 1}\n{"text": "caf\xe9"}\n{"text": "end"}\n')
    bad = BadRecords(skip=True)
    assert list(DocumentReader(path, bad=bad)) == ["ok", "end"]
    assert bad.count == 4
    assert bad.examples[0].endswith("bad.jsonl:2: malformed JSON (Expecting value)")


def test_empty_text_field_is_refused_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": "ok"}, {"text": "   "}])
    with pytest.raises(DataError, match=r"e.jsonl:2: empty 'text' field"):
        list(DocumentReader(path))


def test_missing_text_field_lists_the_fields_present(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"content": "x", "id": 3}])
    with pytest.raises(DataError, match=r"f.jsonl:1: no 'text' field \(fields: content, id\); set --text-field"):
        list(DocumentReader(path))


def test_non_utf8_bytes_are_refused_with_line_and_byte(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"good\n\ncaf" + b"\xe9\n")
    with pytest.raises(DataError, match=r"latin1.txt:3: not UTF-8 \(byte 0xe9 at column 4\)"):
        list(DocumentReader(path))


def test_discover_searches_folders_and_globs_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.txt", "a.jsonl", "sub/c.txt.gz", "skip.csv"):
        (tmp_path / name).write_bytes(b"")
    found = discover_inputs([str(tmp_path)])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["a.jsonl", "b.txt", "sub/c.txt.gz"]
    assert discover_inputs([str(tmp_path / "*.txt"), str(tmp_path / "b.txt")]) == [tmp_path / "b.txt"]


def test_discover_refuses_missing_paths_and_unsupported_types(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        discover_inputs([str(tmp_path / "missing.txt")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"unsupported input type; use .txt, .jsonl, .json or .parquet"):
        discover_inputs([str(tmp_path / "x.csv")])


def test_builtin_corpus_ships_python_docs_as_paragraph_documents():
    docs = list(iter_documents([builtin_corpus_path()]))
    assert len(docs) > 2000
    assert sum(len(d) for d in docs) > 400_000
    assert all(d.strip() for d in docs)
    assert any("assert" in d for d in docs)
    assert (builtin_corpus_path().parent / "NOTICE").read_text().count("Python Software Foundation") == 1

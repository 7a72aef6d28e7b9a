"""The commands end to end: train-tokenizer -> prepare-data -> loader, progress output, prepared JSONL as data.path."""

from __future__ import annotations

import io

import numpy as np
import torch
from data_helpers import LLAMA_DIR, needs_llama

from titan_npu.cli import main as cli_main
from titan_npu.data import build_dataloader, build_tokenizer
from titan_npu.data.datasets import read_index
from titan_npu.data.progress import Progress
from titan_npu.data.sources import builtin_corpus_path


def test_train_tokenizer_then_prepare_then_load_uses_its_bos_and_eos(tmp_path, capsys, small_cfg):
    corpus = str(builtin_corpus_path())
    assert cli_main(["train-tokenizer", corpus, "--vocab-size", "400", "--output", str(tmp_path / "tok")]) == 0
    assert "(vocab 400, bos 0, eos 1," in capsys.readouterr().out
    tok = build_tokenizer(str(tmp_path / "tok"))
    assert cli_main(["prepare-data", corpus, "--tokenizer", str(tmp_path / "tok"), "-o", str(tmp_path / "out"),
                     "--workers", "2"]) == 0
    index = read_index(tmp_path / "out")
    assert index["tokenizer"]["fingerprint"] == tok.fingerprint() and index["max_token_id"] < 400
    loader = build_dataloader(small_cfg(str(tmp_path / "out"), seq_len=128), tok, 0, 1, model_vocab_size=400)
    inputs, _ = next(loader)
    assert int(inputs.max()) < 400 and (inputs == tok.bos_id).any()


def test_prepared_jsonl_folder_loads_like_the_shards(corpus_txt, tmp_path, small_cfg):
    for fmt in ("bin", "jsonl"):
        assert cli_main(["prepare-data", str(corpus_txt), "-o", str(tmp_path / fmt), "--format", fmt]) == 0
    byte = build_tokenizer("byte")
    shards = build_dataloader(small_cfg(str(tmp_path / "bin")), byte, 0, 1)
    jsonl = build_dataloader(small_cfg(str(tmp_path / "jsonl")), byte, 0, 1)
    jsonl_file = build_dataloader(small_cfg(str(tmp_path / "jsonl" / "tokens.jsonl")), byte, 0, 1)
    for _ in range(3):
        a, b, c = next(shards), next(jsonl), next(jsonl_file)
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0]) and torch.equal(a[1], b[1])


def test_progress_draws_a_bar_on_a_terminal_and_plain_lines_otherwise():
    bar, lines = io.StringIO(), io.StringIO()
    for stream, is_bar in ((bar, True), (lines, False)):
        p = Progress(1000, stream=stream, bar=is_bar, line_interval_s=0.0)
        p.interval = 0.0
        p.update(10, 2000, 500)
        p.close()
    assert bar.getvalue().startswith("\r[###############...............]  50% 10 docs, 2.0k tokens,")
    assert "docs/s" in bar.getvalue() and "tokens/s" in bar.getvalue() and bar.getvalue().endswith("\n")
    assert lines.getvalue().splitlines()[0].startswith(" 50% 10 docs, 2.0k tokens,")
    assert lines.getvalue().splitlines()[1].startswith("100% ")


@needs_llama
def test_real_llama3_vocab_is_stored_as_uint32_and_round_trips(tmp_path, corpus_txt, llama_hf):
    from titan_npu.data.prepare import prepare

    prepare([str(corpus_txt)], tmp_path / "out", tokenizer=str(LLAMA_DIR))
    index = read_index(tmp_path / "out")
    tok = llama_hf
    docs = [d.strip() for d in corpus_txt.read_text().split("\n\n")]
    expected = np.concatenate([tok.encode(d, bos=True, eos=True) for d in docs])
    assert index["dtype"] == "uint32"
    assert np.array_equal(np.fromfile(tmp_path / "out" / index["shards"][0]["file"], dtype=np.uint32), expected)


def test_cli_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    assert cli_main(["prepare-data", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("DataError: ") and "bad.jsonl:2: 'text' is a int, not a string" in err and "\n" not in err
    assert not (tmp_path / "out").exists()

"""Tokenizers: built-in bytes, tokenizer.json, SentencePiece, tiktoken format; detection, special tokens, errors."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import pytest
from data_helpers import LLAMA_DIR, needs_llama

from titan_npu.data import build_tokenizer, check_vocab
from titan_npu.data.sources import DocumentReader, builtin_corpus_path
from titan_npu.data.tokenizer import LLAMA3_PATTERN
from titan_npu.data.train_tokenizer import train_bpe
from titan_npu.errors import DataError

TEXT = "Hello, world! It's 2024: naïve café, 12345 apples.\n\n    def f(x):\n\treturn x ** 2  # ok"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    train_bpe([str(builtin_corpus_path())], 600, out)
    return out


def test_byte_tokenizer_maps_utf8_bytes_and_wraps_bos_eos():
    tok = build_tokenizer("byte")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    ids = tok.encode("aé", bos=True, eos=True)
    assert ids == [256, 97, 0xC3, 0xA9, 257]
    assert tok.decode(ids) == "aé"
    tokens, lengths = tok.encode_flat(["aé", "", "b"], bos=True, eos=True)
    assert tokens.tolist() == ids + [256, 257, 256, 98, 257] and lengths.tolist() == [5, 2, 3]
    assert [t.tolist() for t in tok.encode_flat(["aé", "b"])] == [[97, 0xC3, 0xA9, 98], [3, 1]]


def test_unknown_tokenizer_path_names_the_accepted_choices(tmp_path):
    with pytest.raises(DataError, match="use 'byte', a tokenizer.json / tokenizer.model"):
        build_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(DataError, match="holds no tokenizer.json or tokenizer.model"):
        build_tokenizer(str(tmp_path))


def test_trained_tokenizer_json_loads_from_file_or_folder_with_config_special_tokens(bpe_dir):
    from_file = build_tokenizer(str(bpe_dir / "tokenizer.json"))
    from_dir = build_tokenizer(str(bpe_dir))
    assert from_file.vocab_size == from_dir.vocab_size == 600
    assert (from_file.bos_id, from_file.eos_id, from_file.pad_id) == (0, 1, 2)
    assert from_file.encode(TEXT) == from_dir.encode(TEXT)
    ids = from_file.encode(TEXT, bos=True, eos=True)
    assert ids[0] == 0 and ids[-1] == 1 and from_file.decode(ids[1:-1]) == TEXT
    assert len(ids) < len(TEXT.encode()) * 0.8  # merges were learnt: fewer tokens than bytes
    tokens, lengths = from_file.encode_flat([TEXT, "x"], bos=True, eos=True)
    assert tokens.tolist() == ids + from_file.encode("x", bos=True, eos=True) and lengths.tolist() == [len(ids), 3]


def test_special_token_from_config_missing_in_vocab_is_refused(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>", "eos_token": "<|pad|>"}))
    with pytest.raises(DataError, match="special token '<nope>' from tokenizer_config.json is not in its vocab"):
        build_tokenizer(str(tmp_path))


def test_sentencepiece_model_is_detected_and_brings_its_own_bos_eos(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    docs = list(DocumentReader(builtin_corpus_path()))[:400]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=model, vocab_size=300,
                                   model_type="bpe", minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    tok = build_tokenizer(str(tmp_path))
    reference = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert type(tok).__name__ == "SentencePieceTokenizer"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (300, reference.bos_id(), reference.eos_id())
    assert tok.encode("the object is returned", bos=True) == [reference.bos_id()] + reference.encode(
        "the object is returned")
    assert tok.decode(tok.encode("the object is returned")) == "the object is returned"


def _tiny_tiktoken_file(path: Path) -> Path:
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" t", b" the"]
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(ranks)))
    return path


def test_tiktoken_format_model_is_detected_with_llama3_specials(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    tok = build_tokenizer(str(_tiny_tiktoken_file(tmp_path / "tokenizer.model")))
    assert type(tok).__name__ == "TiktokenTokenizer"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (261 + 256, 261, 262)
    assert tok.encode("the the") == [258, 260]
    ranks = {bytes([b]): b for b in range(256)} | {b"th": 256, b"he": 257, b"the": 258, b" t": 259, b" the": 260}
    reference = tiktoken.Encoding("ref", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert tok.encode(TEXT) == reference.encode(TEXT)
    # Special-token text inside a document is ordinary text, never a control token.
    assert 262 not in tok.encode("x <|end_of_text|> y")


def test_fingerprint_is_stable_and_tells_tokenizers_apart(bpe_dir, tmp_path):
    pytest.importorskip("tiktoken")
    a = build_tokenizer(str(bpe_dir)).fingerprint()
    assert a == build_tokenizer(str(bpe_dir / "tokenizer.json")).fingerprint()
    # Reformatting the JSON does not change the tokenizer.
    spec = json.loads((bpe_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, indent=4))
    assert build_tokenizer(str(tmp_path / "tokenizer.json")).fingerprint() == a
    # A changed merge list does.
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert build_tokenizer(str(tmp_path / "tokenizer.json")).fingerprint() != a
    tik = build_tokenizer(str(_tiny_tiktoken_file(tmp_path / "t.model"))).fingerprint()
    assert len({a, build_tokenizer("byte").fingerprint(), tik}) == 3


def test_check_vocab_names_both_numbers():
    tok = build_tokenizer("byte")
    check_vocab(tok, 512)
    check_vocab(tok, 258)
    with pytest.raises(DataError, match="has 258 ids but model.vocab_size is 200"):
        check_vocab(tok, 200)


def test_missing_optional_dependency_gives_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken now raises ImportError
    with pytest.raises(DataError, match="needs the 'tiktoken' package, which is not installed; pip install tiktoken"):
        build_tokenizer(str(_tiny_tiktoken_file(tmp_path / "tokenizer.model")))


def test_train_tokenizer_refuses_to_overwrite_and_too_small_vocab(bpe_dir, tmp_path):
    with pytest.raises(DataError, match="already holds a tokenizer.json"):
        train_bpe([str(builtin_corpus_path())], 600, bpe_dir)
    with pytest.raises(DataError, match="--vocab-size 100 is too small; use at least 259"):
        train_bpe([str(builtin_corpus_path())], 100, tmp_path / "t")
    assert not (tmp_path / "t").exists()


@needs_llama
def test_real_llama3_tokenizer_json_tokenises_identically_to_the_tokenizers_library(llama_hf):
    tokenizers = pytest.importorskip("tokenizers")
    ours = llama_hf
    reference = tokenizers.Tokenizer.from_file(str(LLAMA_DIR / "tokenizer.json"))
    docs = list(DocumentReader(builtin_corpus_path()))[:150] + [TEXT, "日本語のテキスト 😀", " leading space"]
    assert ours.encode_batch(docs) == [e.ids for e in reference.encode_batch(docs, add_special_tokens=False)]
    # BOS from tokenizer_config.json is the one the tokenizer's own template adds.
    assert ours.encode(TEXT, bos=True) == reference.encode(TEXT).ids
    assert (ours.bos_id, ours.eos_id) == (128000, 128001)
    assert ours.decode(ours.encode(TEXT)) == TEXT


@needs_llama
def test_real_llama3_tiktoken_model_agrees_with_its_tokenizer_json(llama_hf):
    pytest.importorskip("tiktoken")
    tik = build_tokenizer(str(LLAMA_DIR / "tokenizer.model"))
    hf = llama_hf
    docs = list(DocumentReader(builtin_corpus_path()))[:150] + [TEXT]
    assert tik.encode_batch(docs, bos=True, eos=True) == hf.encode_batch(docs, bos=True, eos=True)
    assert tik.vocab_size == 128256

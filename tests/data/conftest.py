"""Fixtures for the data tests: tiny corpora written to tmp_path, a small config, the packaged Llama tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import LLAMA_DIR, make_docs

from titan_npu.config.schema import JobConfig


@pytest.fixture
def corpus_txt(tmp_path: Path) -> Path:
    """40 documents as blank-line separated blocks."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(make_docs(40)) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def small_cfg():
    """A JobConfig factory with a small batch and sequence."""

    def make(path: str = "", batch_size: int = 2, seq_len: int = 16, num_workers: int = 0, **data) -> JobConfig:
        cfg = JobConfig()
        cfg.training.batch_size = batch_size
        cfg.training.seq_len = seq_len
        cfg.data.path = path
        cfg.data.num_workers = num_workers
        for k, v in data.items():
            setattr(cfg.data, k, v)
        return cfg

    return make


@pytest.fixture(scope="session")
def llama_hf():
    """The packaged Llama 3.2 tokenizer.json, loaded once (it takes about a second)."""
    from titan_npu.data import build_tokenizer

    return build_tokenizer(str(LLAMA_DIR))

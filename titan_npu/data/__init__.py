"""Data: tokenizers, prepare-data (text -> token shards), datasets and the stateful, resumable loader."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_npu.data.loader import TokenLoader, build_dataloader
    from titan_npu.data.sources import builtin_corpus_path
    from titan_npu.data.tokenizer import Tokenizer, build_tokenizer, check_vocab

# Loaded on first use: the prepare-data and tokenizer commands should not pay for importing torch.
_EXPORTS = {
    "Tokenizer": "titan_npu.data.tokenizer",
    "build_tokenizer": "titan_npu.data.tokenizer",
    "check_vocab": "titan_npu.data.tokenizer",
    "builtin_corpus_path": "titan_npu.data.sources",
    "build_dataloader": "titan_npu.data.loader",
    "TokenLoader": "titan_npu.data.loader",
}

__all__ = ["TokenLoader", "Tokenizer", "build_dataloader", "build_tokenizer", "builtin_corpus_path", "check_vocab"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'titan_npu.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

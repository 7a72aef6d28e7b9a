"""train-tokenizer: a byte-level BPE tokenizer.json (tokenizers library) learnt from a corpus."""

from __future__ import annotations

import json
from pathlib import Path

from titan_npu.atomic import atomic_path, atomic_write_json
from titan_npu.data.sources import BadRecords, discover_inputs, iter_documents
from titan_npu.data.tokenizer import _require
from titan_npu.errors import DataError
from titan_npu.outputs import refuse_foreign_names, refuse_protected

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
MIN_VOCAB = 256 + 3  # every byte plus the three special tokens
CONFIG_FILE = "tokenizer_config.json"
CONFIG = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast",
          "model_max_length": 1 << 20}


def _json_file(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def train_bpe(inputs: list[str], vocab_size: int, output: str | Path, text_field: str = "text",
              doc_sep: str = "blank", skip_bad_records: bool = False) -> Path:
    """Learn byte-level BPE merges; write output/tokenizer.json and tokenizer_config.json (bos/eos/pad)."""
    tokenizers = _require("tokenizers", "tokenizers", "train-tokenizer")
    if vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size {vocab_size} is too small; use at least {MIN_VOCAB} (256 bytes + 3 specials)")
    output = Path(output).expanduser()
    refuse_protected("--output", output, DataError)
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file; name a folder (new, or one without a tokenizer)")
    if (output / "tokenizer.json").exists():
        raise DataError(f"--output {output} already holds a tokenizer.json; choose a new --output or delete it")
    # A tokenizer_config.json is ours only as an unfinished run of this command left it (written first).
    refuse_foreign_names("--output", output, [CONFIG_FILE], lambda name: _json_file(output / name) == CONFIG, DataError,
                         "train-tokenizer", "move it away or choose a new --output")
    paths = discover_inputs(inputs)
    bad = BadRecords(skip=skip_bad_records, hint="fix or remove that record, or pass --skip-bad-records")
    seen = [0]

    def documents():
        for text in iter_documents(paths, text_field, doc_sep, bad):
            seen[0] += 1
            yield text

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents(), trainer=trainer)
    if seen[0] == 0:
        raise DataError(f"no documents found in {', '.join(inputs)}; check the inputs and --text-field")
    output.mkdir(parents=True, exist_ok=True)
    # Config first: a folder whose tokenizer.json exists is complete.
    atomic_write_json(output / CONFIG_FILE, CONFIG)
    with atomic_path(output / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    return output / "tokenizer.json"

"""`titan-npu train-tokenizer`: learn a byte-level BPE tokenizer from a corpus."""

from __future__ import annotations

from titan_npu.commands.parsing import CommandParser, parse


def build_parser() -> CommandParser:
    p = CommandParser(prog="titan-npu train-tokenizer",
                                description="Learn a byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json "
                                "with BOS/EOS/PAD) from .txt/.jsonl/.json/.parquet files, folders or globs.")
    p.add_argument("inputs", nargs="+", help="input files, folders or globs")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary size incl. 256 bytes and 3 specials")
    p.add_argument("--output", "-o", required=True, help="folder to write tokenizer.json into")
    p.add_argument("--text-field", default="text", help="text field of .jsonl/.json records and .parquet column")
    p.add_argument("--doc-sep", choices=("blank", "line"), default="blank", help=".txt document separator")
    p.add_argument("--skip-bad-records", action="store_true", help="skip malformed records instead of stopping")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu train-tokenizer`."""
    from titan_npu.data.train_tokenizer import train_bpe

    args, _ = parse("train-tokenizer", build_parser(), argv)
    path = train_bpe(args.inputs, args.vocab_size, args.output, text_field=args.text_field, doc_sep=args.doc_sep,
                     skip_bad_records=args.skip_bad_records)
    from titan_npu.data.tokenizer import build_tokenizer

    tok = build_tokenizer(str(path))
    print(f"wrote {path} (vocab {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_id}, fingerprint {tok.fingerprint()})")
    return 0

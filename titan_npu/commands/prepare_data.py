"""`titan-npu prepare-data`: tokenise a corpus into binary token shards or tokens JSONL."""

from __future__ import annotations

import sys

from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.data.progress import Progress


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="titan-npu prepare-data",
        description="Tokenise .txt/.jsonl/.json/.parquet files (optionally .gz/.zst; files, folders or globs) into "
        "binary token shards plus index.json, or into the guide's tokens JSONL; a Hugging Face dataset on disk is an "
        "input too (a save_to_disk folder, or hf://namespace/name[/subset][?split=...] from the local HF cache, read "
        "offline). Re-running is a no-op when nothing "
        "changed; an interrupted run resumes after its last finished shard.",
    )
    p.add_argument("inputs", nargs="+", help="input files, folders (searched recursively), globs, save_to_disk folders "
                   "or hf://namespace/name[/subset][?split=...]")
    p.add_argument("--output", "-o", required=True, help="output folder (new, empty, or an earlier run's)")
    p.add_argument("--tokenizer", default="byte", help="'byte', tokenizer.json, tokenizer.model or a folder")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (default 1)")
    p.add_argument("--text-field", default="text",
                   help="text field of .jsonl/.json records, .parquet column or HF dataset column")
    p.add_argument("--doc-sep", choices=("blank", "line"), default="blank",
                   help=".txt documents: blocks separated by blank lines (default) or one per line")
    p.add_argument("--format", choices=("bin", "jsonl", "chat", "instruction"), default="bin", dest="fmt",
                   help="bin: uint16/uint32 shards (default); jsonl: {\"tokens\": [...], \"length\": n} per line; "
                   "chat / instruction: records rendered with the chat template into bin shards plus a loss mask "
                   "(docs/sft.md; rendered in one process)")
    p.add_argument("--chat-template", default="", help="chat/instruction: a .jinja file instead of the tokenizer's own "
                   "chat_template")
    p.add_argument("--messages-field", default="messages", help="chat: the field that holds the messages")
    p.add_argument("--prompt-field", default="prompt", help="instruction: the field that holds the prompt")
    p.add_argument("--response-field", default="response", help="instruction: the field that holds the response")
    p.add_argument("--system-field", default="system", help="instruction: the field of an optional system prompt")
    p.add_argument("--max-seq-len", type=int, default=0, help="jsonl: truncate each document to this many tokens")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="count and skip malformed records instead of stopping at the first")
    p.add_argument("--shard-size", type=int, default=1 << 28, help="tokens per shard (default 268435456)")
    p.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="a bar on a terminal (auto), or plain lines")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu prepare-data`."""
    from titan_npu.data.prepare import prepare

    args, _ = parse("prepare-data", build_parser(), argv)
    if args.max_seq_len and args.fmt != "jsonl":
        build_parser().error("--max-seq-len truncates documents of --format jsonl only; windows of bin shards are "
                                "set by training.seq_len")
    progress = None
    if args.progress != "auto":
        from titan_npu.data.sources import discover_inputs, input_size

        total = sum(input_size(p) for p in discover_inputs(args.inputs))
        progress = Progress(total, bar=args.progress == "bar")
    from titan_npu.data.chat import RecordFormat

    records = RecordFormat(args.fmt, args.messages_field, args.prompt_field, args.response_field, args.system_field)
    result = prepare(args.inputs, args.output, tokenizer=args.tokenizer, workers=args.workers,
                     text_field=args.text_field, doc_sep=args.doc_sep, fmt=args.fmt, max_seq_len=args.max_seq_len,
                     skip_bad_records=args.skip_bad_records, shard_size=args.shard_size, progress=progress,
                     records=records, chat_template=args.chat_template)
    if result.up_to_date:
        print(f"{result.output} is up to date ({result.num_documents} documents, {result.num_tokens} tokens)")
        return 0
    secs = max(result.seconds, 1e-9)
    resumed = f", resumed after {result.resumed_docs} documents" if result.resumed_docs else ""
    what = "conversations" if args.fmt in ("chat", "instruction") else "documents"
    print(f"wrote {result.num_documents} {what}, {result.num_tokens} tokens in "
          f"{max(result.num_shards, 1)} file(s) to {result.output} in {result.seconds:.1f}s "
          f"({result.input_bytes / secs / 1e6:.1f} MB/s, {result.num_tokens / secs:,.0f} tokens/s{resumed})")
    if result.bad_records:
        print(f"skipped {result.bad_records} bad record(s); first: " + " | ".join(result.bad_examples),
              file=sys.stderr)
    return 0

"""`titan-npu export`: a training checkpoint's model weights as one full .pt or a Hugging Face directory, or a LoRA
run's adapters in peft's format."""

from __future__ import annotations

import re

from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.errors import CheckpointError

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MiB' / '1000000' -> bytes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def build_parser() -> CommandParser:
    p = CommandParser(
        prog="titan-npu export",
        description="Write a training checkpoint's model weights as one full .pt state dict or a Hugging Face "
                    "directory (safetensors + config.json), from one process.",
        epilog="example: titan-npu export --checkpoint checkpoints/llama3_8b/step-5000 --format hf --dtype bf16 "
               "--output exports/llama-5000",
    )
    p.add_argument("--checkpoint", required=True, help="a step-N directory, or checkpoint.dir (latest, or --step)")
    p.add_argument("--step", type=int, help="which step of --checkpoint (a checkpoint.dir) to export")
    p.add_argument("--format", choices=("pt", "hf", "peft"), default="pt",
                   help="pt: one .pt file; hf: Hugging Face dir; peft: a LoRA run's adapters as peft loads them")
    p.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the weights "
                   "(W + alpha/r B A) for pt or hf")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="weights dtype (default: the checkpoint's "
                   "checkpoint.export_dtype, bf16 unless set)")
    p.add_argument("--output", required=True, help="the .pt file (pt) or directory (hf) to write")
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--tokenizer", help="hf: tokenizer file or directory to copy beside the weights (default: the "
                   "data.tokenizer the checkpoint was trained with; 'none': weights only)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str]) -> int:
    """Entry of `titan-npu export`."""
    args, _ = parse("export", build_parser(), argv)
    from titan_npu.checkpoint import storage
    from titan_npu.checkpoint.export import DTYPES, export_checkpoint, resolve_source

    ref = resolve_source(args.checkpoint, args.step)
    dtype_name = args.dtype or storage.read_info(ref.path).get("export_dtype") or "bf16"
    if dtype_name not in DTYPES:
        raise CheckpointError(f"export dtype {dtype_name!r} is unknown; pass --dtype bf16, fp16 or fp32")
    files = export_checkpoint(ref.path, args.output, args.format, DTYPES[dtype_name],
                              parse_size(args.max_shard_size), overwrite=args.overwrite, tokenizer=args.tokenizer,
                              merge=args.merge)
    total = sum(f.stat().st_size for f in files) / 1e9
    print(f"exported step {ref.step} of {ref.path} as {args.format} ({dtype_name}, {len(files)} file(s), "
          f"{total:.2f} GB) to {args.output}")
    if args.format == "hf" and not args.merge and storage.read_info(ref.path).get("lora"):
        print("these are the frozen base weights of a LoRA run: --format peft writes its adapters, --merge folds them "
              "into the weights")
    return 0

"""`titan-npu export` and `titan-npu import`: training checkpoints <-> full weights."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from titan_npu.atomic import atomic_path
from titan_npu.errors import CheckpointError

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MiB' / '1000000' -> bytes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-npu export",
        description="Write a training checkpoint's model weights as one full .pt state dict or a Hugging Face "
                    "directory (safetensors + config.json), from one process.",
        epilog="example: titan-npu export --checkpoint checkpoints/llama3_8b/step-5000 --format hf --dtype bf16 "
               "--output exports/llama-5000",
    )
    p.add_argument("--checkpoint", required=True, help="a step-N directory, or checkpoint.dir (latest, or --step)")
    p.add_argument("--step", type=int, help="which step of --checkpoint (a checkpoint.dir) to export")
    p.add_argument("--format", choices=("pt", "hf"), default="pt", help="pt: one .pt file; hf: Hugging Face dir")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="weights dtype (default: the checkpoint's "
                   "checkpoint.export_dtype, bf16 unless set)")
    p.add_argument("--output", required=True, help="the .pt file (pt) or directory (hf) to write")
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--tokenizer", help="hf: tokenizer file or directory to copy beside the weights (default: the "
                   "data.tokenizer the checkpoint was trained with; 'none': weights only)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def export_main(argv: list[str]) -> int:
    """Entry of `titan-npu export`."""
    args = _export_parser().parse_args(argv)
    from titan_npu.checkpoint import storage
    from titan_npu.checkpoint.export import DTYPES, export_checkpoint, resolve_source

    ref = resolve_source(args.checkpoint, args.step)
    dtype_name = args.dtype or storage.read_info(ref.path).get("export_dtype") or "bf16"
    if dtype_name not in DTYPES:
        raise CheckpointError(f"export dtype {dtype_name!r} is unknown; pass --dtype bf16, fp16 or fp32")
    files = export_checkpoint(ref.path, args.output, args.format, DTYPES[dtype_name],
                              parse_size(args.max_shard_size), overwrite=args.overwrite, tokenizer=args.tokenizer)
    total = sum(f.stat().st_size for f in files) / 1e9
    print(f"exported step {ref.step} of {ref.path} as {args.format} ({dtype_name}, {len(files)} file(s), "
          f"{total:.2f} GB) to {args.output}")
    return 0


def _import_parser() -> argparse.ArgumentParser:
    """`titan-npu import`'s options; the model types it names are the registry's."""
    from titan_npu.models.registry import SPECS

    model_types = ", ".join(dict.fromkeys(t for spec in SPECS.values() if spec.hf for t in spec.hf.model_types))
    p = argparse.ArgumentParser(
        prog="titan-npu import",
        description=f"Convert Hugging Face weights (config.json's model_type: {model_types}), Meta "
                    "consolidated.*.pth or a step-N checkpoint into one full .pt state dict under "
                    "this project's names (for checkpoint.initial_load, which also takes the Hugging Face directory "
                    "itself).",
        epilog="example: titan-npu import --input Meta-Llama-3-8B-hf --output llama3_8b.pt --dtype bf16",
    )
    p.add_argument("--input", required=True, help="Hugging Face dir, Meta dir / consolidated.00.pth, or step-N dir")
    p.add_argument("--output", required=True, help="the .pt file to write")
    p.add_argument("--dtype", choices=("keep", "bf16", "fp16", "fp32"), default="keep",
                   help="weights dtype (default: keep the input's)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def model_section(args) -> str:
    """The [model] lines that reproduce these shapes in a config."""
    lines = ["[model]", f'name = "{args.family}"']
    if args.flavor != "custom":
        lines.append(f'flavor = "{args.flavor}"')
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "norm_eps",
                "rope_theta", "max_seq_len"):
        lines.append(f"{key} = {getattr(args, key)}")
    if args.rope_scaling_factor:
        lines.append(f"rope_scaling_factor = {args.rope_scaling_factor}")
    for key in ("qkv_bias", "qk_norm", "tie_embeddings"):
        lines.append(f"{key} = {str(bool(getattr(args, key, False))).lower()}")
    # A mixture-of-experts model's routing and attention shapes (qwen3_moe, deepseek_v3): TOML spells these values
    # as JSON does.
    for key in ("n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                "router_aux_loss_coef", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_shared_experts", "n_groups", "topk_groups", "route_scale", "first_k_dense",
                "mtp_depth"):
        if hasattr(args, key):
            lines.append(f"{key} = {json.dumps(getattr(args, key))}")
    if getattr(args, "yarn_factor", None) is not None:  # DeepSeek's and gpt-oss's YaRN RoPE
        lines += [f"{key} = {json.dumps(getattr(args, key))}" for key in ("yarn_factor", "yarn_original_seq_len",
                  "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_truncate")
                  if hasattr(args, key)]
    for key in ("sliding_window", "layer_types", "swiglu_limit"):  # gpt-oss's attention and experts
        if hasattr(args, key):
            lines.append(f"{key} = {json.dumps(getattr(args, key))}")
    return "\n".join(lines)


def _own_storage(t):
    # torch.save writes a tensor's whole storage: a view into a larger buffer (mmap, slice) would save all of it.
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def import_main(argv: list[str]) -> int:
    """Entry of `titan-npu import`."""
    args = _import_parser().parse_args(argv)
    import torch

    from titan_npu.checkpoint.export import DTYPES, refuse_overlap
    from titan_npu.checkpoint.formats import read_weights

    output = Path(args.output)
    refuse_overlap("--output", output, "input", Path(args.input))
    if output.exists() and not args.overwrite:
        raise CheckpointError(f"--output {output} already exists; remove it, choose another path or pass --overwrite")
    if output.is_dir():
        raise CheckpointError(f"--output {output} is a directory; give a file name such as model.pt")
    weights = read_weights(args.input, None if args.dtype == "keep" else DTYPES[args.dtype])
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp:
        torch.save({k: _own_storage(v) for k, v in weights.state_dict.items()}, tmp)
    n_params = sum(v.numel() for v in weights.state_dict.values())
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in weights.state_dict.values()})
    print(f"imported {weights.format} weights from {args.input}: {len(weights.state_dict)} tensors, "
          f"{n_params / 1e6:.1f}M parameters ({', '.join(dtypes)}) -> {output}")
    if weights.note:
        print(weights.note)
    if weights.args is not None:
        print("train from it with these lines in the config:\n" + model_section(weights.args) +
              f'\n\n[checkpoint]\ninitial_load = "{output}"')
    return 0

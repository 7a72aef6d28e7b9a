"""`titan-npu import`: Hugging Face / Meta weights or a step-N checkpoint -> one full .pt under this project's
names."""

from __future__ import annotations

import json
from pathlib import Path

from titan_npu.atomic import atomic_path
from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.errors import CheckpointError
from titan_npu.outputs import check_file_output


def build_parser() -> CommandParser:
    """`titan-npu import`'s options; the model types it names are the registry's."""
    from titan_npu.models.registry import SPECS

    model_types = ", ".join(dict.fromkeys(t for spec in SPECS.values() if spec.hf for t in spec.hf.model_types))
    p = CommandParser(
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
    # The family's own keys (routing, attention shapes, RoPE scaling): TOML spells these values as JSON does.
    from titan_npu.models.registry import spec_of

    spec = spec_of(args)
    lines += [f"{key} = {json.dumps(value)}" for key, value in spec.model_lines(args)]
    keys = {"[model]", "name", "flavor", *spec.model_keys}  # a key the family lacks would be refused
    return "\n".join(line for line in lines if line.split(" = ")[0] in keys)


def _own_storage(t):
    # torch.save writes a tensor's whole storage: a view into a larger buffer (mmap, slice) would save all of it.
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def main(argv: list[str]) -> int:
    """Entry of `titan-npu import`."""
    args, _ = parse("import", build_parser(), argv)
    import torch

    from titan_npu.checkpoint.export import DTYPES, refuse_overlap
    from titan_npu.checkpoint.formats import read_weights

    output = Path(args.output)
    refuse_overlap("--output", output, "input", Path(args.input))
    check_file_output("--output", output, args.overwrite, CheckpointError, "weights file",
                      "is a directory; give a file name such as model.pt")
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

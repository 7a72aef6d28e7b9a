"""`titan-npu generate`: sample text from a trained checkpoint (the decoding itself is tools/generate.py)."""

from __future__ import annotations

import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch


def _dtype(name: str, device_type: str) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def build_parser() -> CommandParser:
    p = CommandParser(prog="titan-npu generate", description="Sample text from a trained checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a full .pt state dict (titan-npu export) or a DCP step dir")
    p.add_argument("--config", help="the run's config (default: config.toml beside the checkpoint or its log dir)")
    p.add_argument("--prompt", default="", help="text to continue (default: start from BOS); with --chat: the one "
                   "user message to answer (without it --chat reads user messages from stdin, one per line)")
    p.add_argument("--chat", action="store_true", help="chat: the messages go through the tokenizer's chat template "
                   "(or --chat-template) with the generation prompt; each reply stops at the template's end of turn")
    p.add_argument("--system", default="", help="--chat: a system message that opens the conversation")
    p.add_argument("--chat-template", default="", help="--chat: a .jinja file instead of the config's "
                   "data.chat_template or the tokenizer's own")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1.0 = off)")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tokenizer", help="override the config's data.tokenizer")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="weights' dtype (auto: fp32 on cpu, bf16 on accelerators)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv: list[str]) -> int:
    """`titan-npu generate --checkpoint DIR --prompt "..." --max-new-tokens N --temperature T --top-k K`."""
    args, _ = parse("generate", build_parser(), argv)  # before torch is imported: a refusal is instant
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a byte of another encoding, kept by Python as a lone surrogate
        raise ConfigError(f"--prompt is not UTF-8 text (byte 0x{ord(args.prompt[e.start]) & 0xFF:02x} at character "
                          f"{e.start + 1}); pass the prompt in UTF-8 (check the terminal's locale)") from None
    from titan_npu.checkpoint.fit import load_model
    from titan_npu.data import build_tokenizer
    from titan_npu.device import setup_device
    from titan_npu.tools.generate import banned_token_mask, generate, resolve_checkpoint

    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        raise CheckpointError(f"--checkpoint {ckpt} does not exist; give a .pt file or a checkpoint directory")
    weights, model_args, tokenizer_spec = read_for_inference(resolve_checkpoint(ckpt), args.config, args.tokenizer)
    tokenizer = build_tokenizer(tokenizer_spec)

    device = setup_device()
    model = load_model(weights.state_dict, model_args, device.torch_device, _dtype(args.dtype, device.type))
    vocab = model.output.out_features
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {vocab}; pass the run's "
                          "tokenizer with --tokenizer")
    if args.chat:
        return _chat(args, ckpt, tokenizer, tokenizer_spec, model, device)
    prompt_ids = tokenizer.encode(args.prompt, bos=True)
    limit = model.freqs_cos.shape[0] - 1
    if len(prompt_ids) > limit:
        print(f"prompt is {len(prompt_ids)} tokens; keeping the last {limit} (model.max_seq_len)", file=sys.stderr)
        prompt_ids = prompt_ids[-limit:]
    banned = banned_token_mask(vocab, tokenizer.vocab_size, [tokenizer.bos_id, tokenizer.pad_id], device.torch_device)

    t0 = time.perf_counter()
    try:
        samples = generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                           args.num_samples, tokenizer.eos_id, banned, args.seed)
    except RuntimeError as e:  # torch.OutOfMemoryError is one; the CPU allocator raises a plain RuntimeError
        if "allocate" not in str(e).lower() and "out of memory" not in str(e).lower():
            raise
        raise ConfigError(f"--num-samples {args.num_samples}: the decoder's key/value cache for that many samples "
                          f"does not fit in {device.type} memory; ask for fewer samples (or a shorter prompt and "
                          f"--max-new-tokens)") from None
    seconds = time.perf_counter() - t0
    for i, ids in enumerate(samples):
        if i:
            print("\n" + "-" * 40)
        print(args.prompt + tokenizer.decode(ids), flush=True)
    n = sum(len(s) for s in samples)
    print(f"\n[{n} tokens in {seconds:.2f}s, {n / max(seconds, 1e-9):.1f} tokens/s on {device.type}]", file=sys.stderr)
    # The decoder stops where the model's context ends (tools/generate.py): a cut sample is said, not silent.
    room = limit + 2 - len(prompt_ids)
    cut = sum(len(ids) >= room for ids in samples)
    if args.max_new_tokens > room and cut:
        print(f"generate: stopped at model.max_seq_len={limit + 1}: the {len(prompt_ids)}-token prompt left room for "
              f"{room} new tokens, so {args.max_new_tokens - room} of the --max-new-tokens {args.max_new_tokens} "
              f"were not generated ({cut} of {len(samples)} sample(s) reached the end); use a shorter --prompt or "
              f"a model with a longer context", file=sys.stderr)
    return 0


def _chat(args: Any, ckpt: Path, tokenizer: Any, tokenizer_spec: str, model: Any, device: Any) -> int:
    """--chat: answer --prompt once, or each line of stdin as the next user turn of one conversation."""
    from titan_npu.config.loader import load_config
    from titan_npu.data.chat import BadRecord, load_chat_template
    from titan_npu.tools.generate import banned_token_mask, find_config, generate

    if args.num_samples != 1:
        raise ConfigError(f"--chat answers with one reply per turn; leave out --num-samples {args.num_samples}")
    override = args.chat_template
    if not override:
        config_path = Path(args.config) if args.config else find_config(ckpt)
        override = load_config(config_path).data.chat_template if config_path is not None else ""
    template = load_chat_template(tokenizer, tokenizer_spec, override)
    end_of_turn = tokenizer.token_id(template.end_of_turn) if template.end_of_turn else None
    vocab = model.output.out_features
    banned = banned_token_mask(vocab, tokenizer.vocab_size, [tokenizer.bos_id, tokenizer.pad_id], device.torch_device)
    limit = model.freqs_cos.shape[0] - 1
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = not args.prompt
    turns = [args.prompt] if not interactive else _stdin_turns()
    for text in turns:
        messages.append({"role": "user", "content": text})
        try:
            rendered, _ = template.render(messages, add_generation_prompt=True)
        except BadRecord as e:
            raise ConfigError(f"--chat: {e}; fix the template or the messages") from None
        ids, _ = tokenizer.encode_chat(rendered)
        if len(ids) > limit:
            raise ConfigError(f"--chat: the conversation is {len(ids)} tokens, over model.max_seq_len={limit + 1}; "
                              "start a new one (a shorter --system or message)")
        reply_ids = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, 1,
                             tokenizer.eos_id, banned, args.seed,
                             stop_ids=(end_of_turn,) if end_of_turn is not None else ())[0]
        reply = tokenizer.decode(reply_ids)
        messages.append({"role": "assistant", "content": reply if reply.strip() else " "})
        print(reply, flush=True)
    return 0


def _stdin_turns():
    """User messages from stdin, one per line, until EOF or an empty line; a '> ' prompt when it is a terminal."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return
        yield line.rstrip("\n")


def read_for_inference(ckpt: Path, config: str | None, tokenizer: str | None, command: str = "generate"
                       ) -> tuple[Any, Any, str]:
    """(weights, model args, tokenizer spec) that `generate` and `eval` read a checkpoint with: the shapes recorded
    with the weights (DCP checkpoint.json, Hugging Face config.json) win over the config's, and what the config
    loses is said (say_what_the_config_loses); the config is the one given or found beside the checkpoint."""
    from titan_npu.checkpoint.formats import read_weights
    from titan_npu.config.loader import load_config
    from titan_npu.models.registry import build_model_args
    from titan_npu.tools.generate import find_config

    config_path = Path(config) if config else find_config(ckpt)
    cfg = load_config(config_path) if config_path is not None else None
    if cfg is None and not tokenizer:
        raise ConfigError(f"no config.toml beside {ckpt} (looked in its folder and two above); pass --config with "
                          "the config the model was trained with (or --tokenizer for a checkpoint that has shapes)")
    weights = read_weights(ckpt)
    model_args = weights.args
    if model_args is None:
        if cfg is None:
            raise ConfigError(f"{ckpt} records no model shapes; pass --config with the config it was trained with")
        model_args = build_model_args(cfg.model)
    elif cfg is not None:
        say_what_the_config_loses(ckpt, config_path, model_args, build_model_args(cfg.model), bool(config), command)
    return weights, model_args, tokenizer or cfg.data.tokenizer


def say_what_the_config_loses(ckpt: Path, config_path: Path, recorded: Any, configured: Any, explicit: bool,
                              command: str = "generate") -> None:
    """The checkpoint's recorded model is the one generated with: refuse an explicit --config that names another
    family, and say in one line which [model] values of the config are not used."""
    family, other = getattr(recorded, "family", type(recorded).__name__), getattr(configured, "family", None)
    if type(recorded) is not type(configured) or family != other:
        if explicit:
            raise ConfigError(f"--config {config_path} describes a {other} model, but {ckpt} records a {family} "
                              f"model; pass the config the checkpoint was trained with (or leave --config out: the "
                              f"checkpoint's own model and the config beside it are used)")
        print(f"{command}: {config_path} describes a {other} model, but {ckpt} records a {family} model; its "
              f"[model] is not used (the checkpoint's is), only its tokenizer", file=sys.stderr)
        return
    differing = [f"{f.name} {getattr(recorded, f.name)!r} (config: {getattr(configured, f.name)!r})"
                 for f in fields(recorded) if f.name not in ("flavor", "use_flash_attention")
                 and getattr(recorded, f.name) != getattr(configured, f.name)]
    if differing:
        shown = ", ".join(differing[:4]) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
        print(f"{command}: {ckpt} records its model's shapes, which are used instead of {config_path}'s [model]: "
              f"{shown}", file=sys.stderr)

"""`titan-npu <command>`: one entry for every tool; user errors print one line, `--debug` shows the traceback."""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help); each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("titan_npu.train", "main", "train a model from a config (same as python train.py)"),
    "prepare-data": ("titan_npu.data.cli", "prepare_data_main", "tokenize a corpus into binary shards or JSONL"),
    "train-tokenizer": ("titan_npu.data.cli", "train_tokenizer_main", "train a BPE tokenizer on a corpus"),
    "export": ("titan_npu.checkpoint.cli", "export_main", "export a checkpoint to a full .pt or Hugging Face"),
    "import": ("titan_npu.checkpoint.cli", "import_main", "convert Hugging Face / Meta weights to a .pt"),
    "init-weights": ("titan_npu.checkpoint.seed", "init_weights_main",
                     "write a config's initial weights as a checkpoint any layout starts from"),
    "plan": ("titan_npu.tools.plan", "main", "plan memory and parallel layout before launch"),
    "doctor": ("titan_npu.tools.doctor", "main", "check versions, devices, environment and collectives"),
    "generate": ("titan_npu.tools.generate", "main", "sample text from a checkpoint"),
    "report": ("titan_npu.metrics.report", "main", "plot and summarise a run from its log dir"),
    "bench": ("titan_npu.tools.bench", "main", "measure throughput, MFU and memory"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: titan-npu <command> [options]   (titan-npu <command> --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def run_command(func, argv: list[str]) -> int:
    """Run a command's main; a TitanError becomes one line on stderr and exit code 2 (traceback with --debug)."""
    from titan_npu.errors import TitanError

    debug = "--debug" in argv or bool(_env_flag("TITAN_DEBUG"))
    try:
        return int(func(argv) or 0)
    except TitanError as e:
        if debug:
            raise
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _env_flag(name: str) -> str:
    import os

    return os.environ.get(name, "")


def main(argv: list[str] | None = None) -> int:
    """Dispatch `titan-npu <command> ...` to the command's module."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from titan_npu import __version__

        print(f"titan-npu {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"titan-npu: unknown command '{name}'{hint}; run 'titan-npu --help' for the list", file=sys.stderr)
        return 2
    module, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module), func_name)
    return run_command(func, rest)


if __name__ == "__main__":
    sys.exit(main())

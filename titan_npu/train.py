"""The train entry (train.py at the repository root, `titan-npu train`): `main(argv, setup=f)` parses, loads the
config and trains; `cli_main()` is train.py's process entry. Both live with the other command mains in commands/."""

from titan_npu.commands.train import cli_main, main

__all__ = ["cli_main", "main"]

"""Digest of every plan the shipped configs and published runs produce: a refactor that must not change a plan
compares this script's output before and after (`python benchmarks/plan_digest.py > before.txt`, change, again,
`diff`).

Covered: `plan` and `plan --json` of every config in configs/ on 1 and 2 nodes of 8 910B2 and of 8 H100, `plan
--reproduce` of every published run, and the dry run of every config at 8 ranks (`train --dry-run --world-size 8`).
Each line is `<sha256 of the output> <exit code> <command>`; a command's output is its stdout and stderr together,
with wall-clock durations (`0.4s`) masked.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_DURATION = re.compile(r"\b\d+(\.\d+)?s\b")  # "checked ...; 0.4s": the one part of an output that is timed


def _run(argv: list[str]) -> tuple[int, str]:
    from titan_npu.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue()


def commands(only: str = "") -> list[list[str]]:
    """Every command whose output is digested (configs whose name contains `only`, if given)."""
    configs = sorted(p for p in (REPO / "configs").iterdir() if p.suffix in (".toml", ".yaml") and only in p.name)
    cmds: list[list[str]] = []
    for cfg in configs:
        rel = str(cfg.relative_to(REPO))
        for device in ("910B2", "H100"):
            for nodes in ("1", "2"):
                base = ["plan", "--config", rel, "--nodes", nodes, "--devices-per-node", "8", "--device", device]
                cmds += [base, base + ["--json"]]
        cmds.append(["train", "--config", rel, "--dry-run", "--world-size", "8"])
    if not only:
        for run in sorted((REPO / "benchmarks" / "published").glob("*.toml")):
            cmds.append(["plan", "--reproduce", str(run.relative_to(REPO))])
    return cmds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="only the configs whose file name contains this")
    args = parser.parse_args()
    import os

    os.chdir(REPO)
    for argv in commands(args.only):
        code, text = _run(argv)
        text = _DURATION.sub("<t>s", text)
        print(hashlib.sha256(text.encode()).hexdigest()[:16], code, " ".join(argv), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

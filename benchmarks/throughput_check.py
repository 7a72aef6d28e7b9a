"""Does the throughput the trainer prints agree with tokens / wall-clock measured from outside the process?

    python benchmarks/throughput_check.py                       # configs/debug.toml, 50 steps, 5% tolerance
    python benchmarks/throughput_check.py --steps 50 -- --training.batch_size 4   # extra train.py overrides

The script runs `python train.py` (or torchrun with --nproc N) as a child process and stamps every line of its
output with this process's clock as it arrives. The outside figure is the tokens of steps 2..N divided by the time
between the `[Step 1]` and `[Step N]` lines: the first step (start-up, allocator warm-up, compilation) is left out
on both sides. The inside figure is what the step lines showed over the same steps: their tokens divided by the
sum of their windows' seconds (step_time_s x window_steps from metrics.jsonl), i.e. the time-weighted mean of the
printed throughput. Exit code 0 when they agree within --tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^(?:\[rank\d+\] )?\[Step (\d+)\] loss=")


def run_and_stamp(cmd: list[str], env: dict[str, str]) -> dict[int, float]:
    """Run cmd, echo its output, and return {step: arrival time of its step line}."""
    stamps: dict[int, float] = {}
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:
            now = time.perf_counter()
            match = STEP_LINE.match(line)
            if match:
                stamps.setdefault(int(match.group(1)), now)
            sys.stdout.write(line)
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"training exited with code {rc}")
    return stamps


def inside_figure(metrics_path: Path, first: int, last: int) -> tuple[int, float, list[float]]:
    """(tokens, seconds, printed tokens/s per window) of the logged windows after step `first` up to `last`."""
    tokens, seconds, shown = 0, 0.0, []
    previous_seen = None
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" not in rec:
            continue
        if rec["step"] == first:
            previous_seen = rec["tokens_seen"]
        elif first < rec["step"] <= last:
            window_seconds = rec["step_time_s"] * rec["window_steps"]
            tokens += rec["tokens_seen"] - previous_seen
            previous_seen = rec["tokens_seen"]
            seconds += window_seconds
            shown.append(rec["tokens_per_s"])
    return tokens, seconds, shown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/debug.toml")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun --standalone) ")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("overrides", nargs="*", help="more train.py overrides, after --")
    args = p.parse_args(argv)

    log_dir = Path(tempfile.mkdtemp(prefix="throughput_check_"))
    train = ["train.py", "--config", args.config, "--training.max_steps", str(args.steps),
             "--metrics.log_interval", str(args.log_interval), "--metrics.log_dir", str(log_dir),
             "--metrics.progress", "lines", "--metrics.report", "false", "--metrics.tensorboard", "false",
             "--checkpoint.enable", "false", "--checkpoint.dir", str(log_dir / "checkpoints"),
             "--validation.enable", "false", *args.overrides]
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *train]
    else:
        cmd = [sys.executable, *train]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    stamps = run_and_stamp(cmd, env)
    if 1 not in stamps or args.steps not in stamps:
        raise SystemExit(f"step lines 1 and {args.steps} not both seen (got {sorted(stamps)})")

    tokens, seconds, shown = inside_figure(log_dir / "metrics.jsonl", 1, args.steps)
    outside_seconds = stamps[args.steps] - stamps[1]
    inside_tps = tokens / seconds
    outside_tps = tokens / outside_seconds
    diff = inside_tps / outside_tps - 1
    print()
    print(f"steps 2..{args.steps}: {tokens:,} tokens")
    print(f"  shown by the step lines : {inside_tps:,.1f} tokens/s over {seconds:.2f} s "
          f"(per window: {', '.join(f'{x:,.0f}' for x in shown)})")
    print(f"  measured from outside   : {outside_tps:,.1f} tokens/s over {outside_seconds:.2f} s "
          f"([Step 1] line to [Step {args.steps}] line)")
    ok = abs(diff) <= args.tolerance
    print(f"  difference              : {100 * diff:+.2f}% ({'within' if ok else 'OUTSIDE'} "
          f"{100 * args.tolerance:.0f}%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One-device speed of the 1B model: tokens/s, MFU, peak memory, the compile speed-up, the attention kernel, and
the float8 column.

    python benchmarks/device_mfu.py                       # configs/llama3_1b.toml, bf16, compiled, seq 2048
    python benchmarks/device_mfu.py --steps 20 --warmup 5 --training.batch_size 4
    python benchmarks/device_mfu.py --config configs/llama3_8b.toml --float8 on
    bash benchmarks/device_mfu.sh                         # the same, from a bare checkout

`titan-npu bench` runs of the same config in child processes (each with its own allocator and compile caches):
compiled, then eager, then (--float8 auto: where the device has float8 tensor cores) compiled with float8
(float8.enable, tensorwise; docs/float8.md). The compiled run gives tokens/s, MFU against the device's dense bf16
peak (the peak table of titan_npu/device/flops.py; a measured matmul peak where the device is not in it) and peak
memory; the eager run the compile speed-up; the float8 run its tokens/s, speed-up over the compiled bf16 run, MFU
against the dense float8 peak and peak memory. Data: the corpus shipped with the project, byte tokenizer (speed does not
depend on the text). Gradient accumulation is 1: a step is one micro-batch. Extra --section.key value arguments
go to both runs. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama3_1b.toml"
# The benchmark's own settings on top of the config: one micro-batch per step, the shipped corpus, bf16.
BENCH_OVERRIDES = ["--training.gradient_accumulation_steps", "1", "--training.dtype", "bf16",
                   "--data.path", "", "--data.tokenizer", "byte"]


FLOAT8_MODES = ("auto", "on", "off", "emulate")


def bench(config: Path, steps: int, warmup: int, compiled: bool, overrides: list[str], label: str = "") -> dict:
    """One `titan-npu bench --json` run in a child process; its result object."""
    cmd = [sys.executable, "-m", "titan_npu.cli", "bench", "--config", str(config), "--steps", str(steps),
           "--warmup", str(warmup), "--json", *BENCH_OVERRIDES, "--compile.enable", str(compiled).lower(),
           *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    # The run's log goes on to stderr as it happens (the compile can take a minute); stdout is its JSON.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"device_mfu: the {label or ('compiled' if compiled else 'eager')} run failed "
                         f"(exit {proc.returncode}): {' '.join(cmd)}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def float8_peak_tflops(device_name: str) -> float:
    """The device's dense float8 peak in TFLOP/s from the table; 0 where it has none."""
    sys.path.insert(0, str(ROOT))
    from titan_npu.device.flops import lookup_float8_flops

    return lookup_float8_flops(device_name) / 1e12


def float8_column(compiled: dict, float8: dict | None, why_not: str = "") -> dict:
    """The float8 figures: tokens/s, speed-up over the compiled bf16 run, MFU against the float8 peak (None where
    the device has no float8 peak: emulation), peak memory; or why the float8 run was not made."""
    if float8 is None:
        return {"float8_run": False, "float8_not_run": why_not}
    peak = float8_peak_tflops(float8["device_name"])
    return {"float8_run": True, "float8_tokens_per_s": float8["tokens_per_s"],
            "float8_speedup": float8["tokens_per_s"] / compiled["tokens_per_s"],
            "float8_mfu": float8["tflops_per_device"] / peak if peak else None, "float8_peak_tflops": peak,
            "float8_peak_memory_gb": float8["peak_memory_gb"], "float8_emulated": float8.get("float8_emulated", False)}


def summary(compiled: dict, eager: dict, float8: dict | None = None, why_not: str = "") -> dict:
    """The figures the benchmark reports, from the runs."""
    return {
        "device": compiled["device"], "device_name": compiled["device_name"],
        "params": compiled["params"], "seq_len": compiled["seq_len"], "batch_size": compiled["batch_size"],
        "dtype": compiled["dtype"],
        "tokens_per_s": compiled["tokens_per_s"], "eager_tokens_per_s": eager["tokens_per_s"],
        "mfu": compiled["mfu"], "peak_tflops": compiled["peak_tflops"],
        "tflops_per_device": compiled["tflops_per_device"],
        "peak_memory_gb": compiled["peak_memory_gb"], "peak_reserved_gb": compiled["peak_reserved_gb"],
        "eager_peak_memory_gb": eager["peak_memory_gb"],
        "compile_speedup": compiled["tokens_per_s"] / eager["tokens_per_s"],
        "attention": compiled["attention"],
        "step_time_s": compiled["step_time"]["median"],
        "wall_s": compiled["wall_s"] + eager["wall_s"] + (float8["wall_s"] if float8 else 0.0),
        **float8_column(compiled, float8, why_not),
        "compiled": compiled, "eager": eager, "float8": float8,
    }


def format_summary(s: dict) -> str:
    """The human-readable report."""
    memory = "process peak RSS" if s["device"] == "cpu" else f"allocated ({s['peak_reserved_gb']:.1f} GB reserved)"
    return "\n".join([
        f"device_mfu: {s['params'] / 1e6:,.1f}M params, {s['dtype']}, {s['batch_size']} x {s['seq_len']} tokens per "
        f"step on 1 {s['device']} ({s['device_name']})",
        f"  tokens/s          {s['tokens_per_s']:,.0f} compiled, {s['eager_tokens_per_s']:,.0f} eager",
        f"  MFU               {s['mfu'] * 100:.1f}% ({s['tflops_per_device']:.1f} of {s['peak_tflops']:.1f} "
        f"TFLOP/s dense {s['dtype']} peak)",
        f"  peak memory       {s['peak_memory_gb']:.1f} GB {memory}; eager {s['eager_peak_memory_gb']:.1f} GB",
        f"  compile speed-up  {s['compile_speedup']:.2f}x (compiled vs eager tokens/s)",
        f"  attention         {s['attention']}",
        f"  step time         {s['step_time_s'] * 1e3:.1f} ms median (compiled); {s['wall_s']:.0f} s for all runs",
        _format_float8(s),
    ])


def _format_float8(s: dict) -> str:
    if not s["float8_run"]:
        return f"  float8            not run: {s['float8_not_run']}"
    mfu = (f"MFU {s['float8_mfu'] * 100:.1f}% of {s['float8_peak_tflops']:.0f} TFLOP/s dense float8 peak"
           if s["float8_mfu"] is not None else "no float8 peak (emulated: float8 casts, high-precision matmuls)")
    return (f"  float8            {s['float8_tokens_per_s']:,.0f} tokens/s compiled, {s['float8_speedup']:.2f}x bf16; "
            f"{mfu}; peak memory {s['float8_peak_memory_gb']:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="model config (default configs/llama3_1b.toml)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring, compilation included (default 3)")
    p.add_argument("--float8", choices=FLOAT8_MODES, default="auto",
                   help="the float8 run: auto (where the device has a float8 peak), on, off, or emulate (any device; "
                        "float8 casts with high-precision matmuls, to test the column)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args, overrides = p.parse_known_args(argv)
    compiled = bench(args.config, args.steps, args.warmup, True, overrides)
    eager = bench(args.config, args.steps, args.warmup, False, overrides)
    float8, why_not = None, ""
    if args.float8 == "off":
        why_not = "--float8 off"
    elif args.float8 == "auto" and not float8_peak_tflops(compiled["device_name"]):
        why_not = f"{compiled['device_name']} has no float8 peak in titan_npu/device/flops.py (--float8 on to try)"
    else:
        flags = ["--float8.enable", "true", "--float8.emulate", str(args.float8 == "emulate").lower()]
        float8 = bench(args.config, args.steps, args.warmup, True, [*overrides, *flags], label="float8")
        float8["float8_emulated"] = args.float8 == "emulate"
    s = summary(compiled, eager, float8, why_not)
    print(json.dumps(s) if args.json else format_summary(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

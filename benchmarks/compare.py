"""Paired, alternating speed comparison: our trainer vs a plain PyTorch loop vs transformers' Llama, and our options.

    python benchmarks/compare.py                                   # S1 and S2 x fp32, bf16, bf16-pure
    python benchmarks/compare.py --shapes S2 --dtypes bf16 --windows 7 --steps 2
    python benchmarks/compare.py --study options --shapes S1 --dtypes fp32
    python benchmarks/compare.py --candidates titan titan:compile bare --reference bare

Every candidate is one long-lived worker process (this script with --worker) that builds its model, runs the
warm-up steps and then waits. The parent runs measuring windows in turn, A B C, B C A, C A B ..., each window `--steps`
optimizer steps of one worker while the others sit idle, so slow drifts of a shared machine's load hit every
candidate alike. Figures are medians over windows; ratios are paired: candidate / reference within the same
round, then the median (and range) over rounds. On cpu the matmul peak (torch.mm 2048^3 in the compute dtype)
is measured once per round as well, and MFU is against the best of those readings (load only ever lowers one).
On Linux each window also records how much of the machine other processes used meanwhile (from /proc: all busy
time minus the worker's process tree); a round is clean when every window in it saw at most --clean of the
machine taken, and the tables use the clean rounds when there are at least 3 of them (the JSON holds both).

Candidates (--candidates, or a --study):
  titan             our Trainer's full path: data loader, metrics log, checks -- `titan-npu train` as configured
                    (on cpu with data.num_workers = 0, as configs/debug.toml; titan:loader2 measures 2 workers)
  titan:V[,V...]    the same with variants (see VARIANTS below), e.g. titan:compile or titan:ac_full,foreach
  bare              a plain loop over our Transformer (benchmarks/bare_loop.py); bare:compile compiles its blocks,
                    bare:torch_ops runs plain torch for every op instead of our kernels (ops.set_kernels("reference"))
  hf                the same plain loop over transformers' LlamaForCausalLM (attn_implementation="sdpa")
  NAME@DIR          candidate NAME running the titan_npu package found in source tree DIR (for before/after
                    measurements of a code change: `git archive HEAD | tar -x -C /tmp/before`, then
                    --candidates bare bare@/tmp/before)
Peak memory is each worker process's peak RSS on cpu (peak allocated on accelerators).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bare_loop import DTYPES, SHAPES, build_loop, dtype_overrides, flops_per_token, synchronize  # noqa: E402
from bare_loop import trainer_overrides as shape_overrides  # noqa: E402

# Trainer variants: config overrides on top of the defaults.
VARIANTS: dict[str, list[str]] = {
    "flash_off": ["--model.use_flash_attention", "false"],
    "ac_full": ["--activation_checkpoint.mode", "full"],
    "ac_selective": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ops", "true"],
    "compile": ["--compile.enable", "true"],
    "foreach": ["--optimizer.implementation", "foreach"],
    "fused": ["--optimizer.implementation", "fused"],
    "loader0": ["--data.num_workers", "0"],
    "loader2": ["--data.num_workers", "2"],
    "tb_off": ["--metrics.tensorboard", "false"],
    "log1": ["--metrics.log_interval", "1"],
    "watchdog_off": ["--reliability.watchdog", "false"],
    "guard_off": ["--reliability.skip_nonfinite", "false", "--reliability.handle_signals", "false"],
    "loss_whole": ["--training.loss_chunk_tokens", "0"],
}
STUDIES = {
    "frameworks": (["titan", "bare", "bare:torch_ops", "hf"], "bare"),
    "options": (["titan", "titan:flash_off", "titan:ac_full", "titan:ac_selective", "titan:compile",
                 "titan:foreach"], "titan"),
}
MARK = "@@bench "  # prefix of the protocol lines a worker writes on stdout
GB = 1024**3


# ---------------------------------------------------------------------------------------------- worker side


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    return getattr(torch, device.type).max_memory_allocated() / GB


def _rss_gb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GB
    except OSError:
        return float("nan")


def _send(message: dict) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _wait_for_command() -> str:
    line = sys.stdin.readline()
    return line.strip() or "exit"


class WindowClock:
    """Called after every step: reports ready after the warm-up, then one result per `steps` steps.

    Between windows it blocks on the parent's next command; the clock restarts when the command arrives, so the
    waiting is never counted.
    """

    def __init__(self, warmup: int, steps: int, tokens_per_step: int, sync) -> None:
        self.warmup, self.steps, self.tokens_per_step, self.sync = warmup, steps, tokens_per_step, sync
        self.count = 0
        self.marks: list[float] = []
        self.stopped = False

    def _wait(self) -> None:
        if _wait_for_command() == "exit":
            self.stopped = True
        self.sync()
        self.marks = [time.perf_counter()]

    def __call__(self, step: int = 0) -> None:
        self.count += 1
        if self.count < self.warmup:
            return
        if self.count == self.warmup:
            self.sync()
            _send({"event": "ready"})
            self._wait()
            return
        self.sync()
        self.marks.append(time.perf_counter())
        if (self.count - self.warmup) % self.steps == 0:
            times = [b - a for a, b in zip(self.marks, self.marks[1:])]
            _send({"event": "window", "step_times": times,
                   "tokens_per_s": self.tokens_per_step * len(times) / sum(times)})
            self._wait()


def run_worker(spec: dict) -> int:
    """A candidate's process: build, warm up, then run windows on command (see WindowClock)."""
    from titan_npu.device import setup_device

    shape, dtype = SHAPES[spec["shape"]], spec["dtype"]
    device = setup_device().torch_device
    sync = lambda: synchronize(device)  # noqa: E731
    warmup, steps, windows = max(1, spec["warmup"]), spec["steps"], spec["windows"]
    rss_base = _rss_gb()
    kind, variants = spec["kind"], spec["variants"]
    if kind == "titan":
        from titan_npu.config.loader import load_config
        from titan_npu.trainer import Trainer

        overrides = shape_overrides(shape) + dtype_overrides(dtype) + [
            "--training.max_steps", str(warmup + steps * windows), "--checkpoint.enable", "false",
            "--metrics.report", "false", "--metrics.log_dir", spec["log_dir"], "--metrics.progress", "lines",
        ]
        if device.type == "cpu":  # what configs/debug.toml and the start-up hint use on cpu (variant loader2: not)
            overrides += VARIANTS["loader0"]
        for v in variants:
            overrides += VARIANTS[v]
        trainer = Trainer(load_config(None, overrides))
        clock = WindowClock(warmup, steps, trainer.tokens_per_step, sync)
        trainer.step_callbacks.append(clock)
        try:
            trainer.train()
        finally:
            trainer.close()
    else:
        if "torch_ops" in variants:  # plain torch for every op: the loop as anyone would write it
            from titan_npu import ops

            ops.set_kernels("reference")
        loop = build_loop("ours" if kind == "bare" else "hf", shape, dtype, device,
                          implementation="foreach" if "foreach" in variants else "fused")
        if "compile" in variants:
            for block in (loop.model.layers.values() if kind == "bare" else loop.model.lm.model.layers):
                block.compile()
        clock = WindowClock(warmup, steps, loop.tokens_per_step, sync)
        for _ in range(warmup + steps * windows):
            loop.step()
            clock()
            if clock.stopped:
                break
    _send({"event": "done", "peak_memory_gb": _peak_memory_gb(device), "rss_base_gb": rss_base})
    return 0


# ---------------------------------------------------------------------------------------------- parent side


@dataclass
class Candidate:
    name: str
    kind: str
    variants: list[str]
    source: str = ""  # a source tree whose titan_npu this candidate imports ("" = the installed one)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    windows: list[dict] = field(default_factory=list)
    done: dict = field(default_factory=dict)


def parse_candidate(name: str) -> Candidate:
    """'titan', 'titan:compile,foreach', 'bare', 'bare:compile', 'hf', 'bare@/tmp/before' -> Candidate."""
    spec, _, source = name.partition("@")
    if source and not (Path(source) / "titan_npu" / "__init__.py").is_file():
        raise SystemExit(f"compare: candidate {name!r}: {source} holds no titan_npu package")
    kind, _, rest = spec.partition(":")
    variants = [v for v in rest.split(",") if v]
    if kind not in ("titan", "bare", "hf"):
        raise SystemExit(f"compare: candidate {name!r}: kind must be titan, bare or hf")
    allowed = VARIANTS if kind == "titan" else {"compile": [], "foreach": [], "torch_ops": []}
    unknown = [v for v in variants if v not in allowed]
    if unknown:
        raise SystemExit(f"compare: candidate {name!r}: unknown variants {unknown} (choose from {sorted(allowed)})")
    return Candidate(name, kind, variants, source=os.path.abspath(source) if source else "")


def _read_message(c: Candidate, timeout_s: float) -> dict:
    """The next protocol line of a worker (its other output goes to its log file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = c.proc.stdout.readline()
        if not line:
            tail = Path(c.log_path).read_text(errors="replace")[-3000:] if c.log_path else ""
            raise RuntimeError(f"worker {c.name} exited (code {c.proc.wait()}); its log ends:\n{tail}")
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {c.name} sent nothing usable within {timeout_s:.0f} s")


def _command(c: Candidate, text: str) -> None:
    c.proc.stdin.write(text + "\n")
    c.proc.stdin.flush()


def measure_peak(dtype: torch.dtype, device_type: str, n: int = 2048) -> float:
    """Matmul peak FLOP/s of the compute dtype: measured now on cpu (n^3 torch.mm), the device table elsewhere."""
    from titan_npu.device import measure_matmul_flops, peak_flops, setup_device

    if device_type == "cpu":
        return measure_matmul_flops.__wrapped__(dtype, n)  # uncached: a fresh reading every round
    return peak_flops(setup_device(), dtype)


def busy_jiffies() -> int | None:
    """CPU time (clock ticks) the whole machine has been busy, steal included; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def tree_jiffies(pid: int) -> int:
    """CPU time (clock ticks) of process `pid` and all its descendants (a worker and its data-loader workers)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, utime + stime)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        stats[int(entry)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += stats.get(current, (0, 0))[1]
        todo += children.get(current, [])
    return total


class Interference:
    """The share of the machine that processes other than one worker's tree used during a window."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.busy0, self.tree0, self.t0 = busy_jiffies(), tree_jiffies(pid), time.monotonic()

    def share(self) -> float | None:
        busy = busy_jiffies()
        if busy is None or self.busy0 is None:
            return None
        foreign = (busy - self.busy0) - (tree_jiffies(self.pid) - self.tree0)
        capacity = (time.monotonic() - self.t0) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
        return max(0.0, foreign / capacity) if capacity > 0 else None


def paired_ratios(values: dict[str, list[float]], reference: str) -> dict[str, list[float]]:
    """Per round, each candidate's value / the reference's value in the same round."""
    ref = values[reference]
    return {name: [v / r for v, r in zip(vals, ref) if r > 0] for name, vals in values.items()}


def summary(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def run_group(shape_name: str, dtype: str, names: list[str], reference: str, args, tmp: str) -> dict:
    """Start one worker per candidate, run `windows` alternating rounds, stop them; the group's results."""
    shape = SHAPES[shape_name]
    candidates = [parse_candidate(n) for n in names]
    compute = torch.float32 if dtype == "fp32" else torch.bfloat16
    from titan_npu.device import detect_device_type

    device_type = detect_device_type()
    peaks: list[float] = []
    fp32_peaks: list[float] = []  # bf16 on cpu: also the fp32 peak, the units widened bf16 matmuls run on
    started = time.monotonic()
    try:
        for i, c in enumerate(candidates):  # one at a time: no build, warm-up or compile overlaps another
            spec = {"kind": c.kind, "variants": c.variants, "shape": shape_name, "dtype": dtype,
                    "warmup": args.warmup, "steps": args.steps, "windows": args.windows,
                    "log_dir": os.path.join(tmp, f"{shape_name}-{dtype}-{i}")}
            c.log_path = os.path.join(tmp, f"{shape_name}-{dtype}-{i}.log")
            log = open(c.log_path, "w")  # noqa: SIM115 -- lives as long as the worker
            env = dict(os.environ)
            if c.source:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [c.source, env.get("PYTHONPATH", "")]))
            c.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env)
            _read_message(c, args.timeout)  # ready
            print(f"  {shape_name} {dtype}: {c.name} ready", flush=True)
        for r in range(args.windows):
            # The order rotates each round (A B C, B C A, C A B, ...): no candidate always runs first or right after
            # the same neighbour, so a position's systematic cost (the first window after the peak reading, a
            # predecessor's lingering threads) falls on every candidate alike.
            for c in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
                time.sleep(args.pause)  # let the previous worker's threads go idle
                watch = Interference(c.proc.pid)
                _command(c, "run")
                c.windows.append(_read_message(c, args.timeout))
                c.windows[-1]["interference"] = watch.share()
            time.sleep(args.pause)
            peaks.append(measure_peak(compute, device_type, args.peak_n))
            if device_type == "cpu" and compute != torch.float32:
                fp32_peaks.append(measure_peak(torch.float32, device_type, args.peak_n))
            line = "  ".join(f"{c.name} {c.windows[-1]['tokens_per_s']:,.0f}" for c in candidates)
            shares = [c.windows[-1]["interference"] for c in candidates]
            other = "" if None in shares else f"  (others used up to {max(shares) * 100:.0f}% of the machine)"
            print(f"  {shape_name} {dtype} round {r + 1}/{args.windows}: tokens/s {line}{other}", flush=True)
        for c in candidates:
            _command(c, "exit")
            c.done = _read_message(c, args.timeout)
            c.proc.wait(timeout=args.timeout)
    finally:
        for c in candidates:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
    fpt = flops_per_token(shape)
    clean = [r for r in range(args.windows)
             if all((c.windows[r].get("interference") or 0.0) <= args.clean for c in candidates)]
    if all(c.windows[0].get("interference") is None for c in candidates):
        clean = []  # no /proc: nothing is known about the other processes
    used = clean if len(clean) >= 3 else list(range(args.windows))
    mem = {c.name: c.done.get("peak_memory_gb", float("nan")) for c in candidates}
    tps_all = {c.name: [w["tokens_per_s"] for w in c.windows] for c in candidates}
    results = []
    for c in candidates:
        entry = {"candidate": c.name}
        for label, rounds in (("all", list(range(args.windows))), ("clean", clean)):
            if not rounds:
                continue
            tps = {n: [v[r] for r in rounds] for n, v in tps_all.items()}
            ratios = paired_ratios(tps, reference)
            entry[label] = {
                "tokens_per_s": summary(tps[c.name]),
                "mfu": summary([t * fpt / max(peaks) for t in tps[c.name]]),
                **({"mfu_fp32_peak": summary([t * fpt / max(fp32_peaks) for t in tps[c.name]])} if fp32_peaks
                   else {}),
                "ratio": summary(ratios[c.name]),
            }
        entry.update(entry["clean" if used is clean else "all"])
        step_times = sorted(s for r in used for s in c.windows[r]["step_times"])
        entry.update({
            "best_tokens_per_s": max(tps_all[c.name]),
            "step_time_median_s": statistics.median(step_times),
            "peak_memory_gb": mem[c.name],
            "memory_ratio": mem[c.name] / mem[reference] if mem.get(reference) else float("nan"),
            "rss_base_gb": c.done.get("rss_base_gb"),
            "windows_tokens_per_s": tps_all[c.name],
            "windows_interference": [w.get("interference") for w in c.windows],
        })
        results.append(entry)
    return {"shape": shape_name, "dtype": dtype, "reference": reference, "peak_tflops": summary(peaks),
            "peaks_tflops_per_round": [p / 1e12 for p in peaks],
            "fp32_peak_tflops": summary(fp32_peaks) if fp32_peaks else None, "flops_per_token": fpt,
            "clean_rounds": clean, "rounds_used": "clean" if used is clean else "all",
            "seconds": time.monotonic() - started, "results": results}


def format_group(g: dict) -> str:
    """A markdown table of one (shape, dtype) group."""
    pk = g["peak_tflops"]
    n = len(g["peaks_tflops_per_round"])
    rounds = (f"medians of the {len(g['clean_rounds'])} clean rounds of {n}" if g["rounds_used"] == "clean"
              else f"medians of all {n} rounds, {len(g['clean_rounds'])} clean")
    fp32 = g.get("fp32_peak_tflops")
    extra = f"; MFU fp32: against the fp32 peak, {fp32[2] / 1e9:.1f} GFLOP/s" if fp32 else ""
    lines = [
        f"**{g['shape']} {g['dtype']}** (MFU against the best matmul peak reading of the compute dtype, "
        f"{pk[2] / 1e9:.1f} GFLOP/s (median {pk[0] / 1e9:.1f}){extra}; {rounds}; ratios vs {g['reference']})",
        "",
        "| candidate | tokens/s | best | MFU |" + (" MFU fp32 |" if fp32 else "")
        + " step ms | ratio | ratio range | peak mem GB | mem ratio |",
        "|---|---:|---:|---:|" + ("---:|" if fp32 else "") + "---:|---:|---:|---:|---:|",
    ]
    for r in g["results"]:
        mfu32 = f" {r['mfu_fp32_peak'][0] * 100:.1f}% |" if fp32 else ""
        lines.append(
            f"| {r['candidate']} | {r['tokens_per_s'][0]:,.0f} | {r['best_tokens_per_s']:,.0f} | "
            f"{r['mfu'][0] * 100:.1f}% |{mfu32} {r['step_time_median_s'] * 1e3:.0f} | {r['ratio'][0]:.3f} | "
            f"{r['ratio'][1]:.3f}-{r['ratio'][2]:.3f} | {r['peak_memory_gb']:.2f} | {r['memory_ratio']:.2f} |"
        )
    return "\n".join(lines)


def machine_line() -> str:
    """Date, torch, cpu model, core count and load: the header every result table carries."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{datetime.datetime.now().isoformat(timespec='minutes')}, torch {torch.__version__}, {model}, "
            f"{os.cpu_count()} cpus, {torch.get_num_threads()} threads, load average {load:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", default=["S1", "S2"], choices=sorted(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--study", choices=sorted(STUDIES), default="frameworks")
    p.add_argument("--candidates", nargs="+", help="explicit candidate list (overrides --study)")
    p.add_argument("--reference", help="candidate the ratios are taken against (default: the study's)")
    p.add_argument("--windows", type=int, default=5, help="rounds; every candidate runs one window per round")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per window")
    p.add_argument("--warmup", type=int, default=2, help="steps before the first window")
    p.add_argument("--pause", type=float, default=0.3, help="seconds between windows")
    p.add_argument("--peak-n", type=int, default=2048, help="size of the n^3 matmul that measures the cpu peak")
    p.add_argument("--clean", type=float, default=0.05,
                   help="a round is clean when other processes used at most this share of the machine")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for any one worker message")
    p.add_argument("--json", dest="json_path", help="write every raw figure to this file")
    p.add_argument("--markdown", help="append the tables to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(json.loads(args.worker))

    names, reference = STUDIES[args.study]
    names = args.candidates or names
    reference = args.reference or (reference if reference in names else names[0])
    if reference not in names:
        raise SystemExit(f"compare: --reference {reference} is not among the candidates {names}")
    header = machine_line()
    print(f"# {header}\n# {' '.join(sys.argv)}", flush=True)
    groups = []
    with tempfile.TemporaryDirectory(prefix="titan-compare-") as tmp:
        for shape in args.shapes:
            for dtype in args.dtypes:
                groups.append(run_group(shape, dtype, names, reference, args, tmp))
                print("\n" + format_group(groups[-1]) + "\n", flush=True)
    footer = machine_line()
    text = "\n\n".join(format_group(g) for g in groups)
    print(f"# finished {footer}")
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write(f"Started {header}; finished {footer}.\n`python {' '.join(sys.argv)}`\n\n{text}\n\n")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"started": header, "finished": footer, "argv": sys.argv,
                                                    "windows": args.windows, "steps": args.steps,
                                                    "warmup": args.warmup, "groups": groups}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

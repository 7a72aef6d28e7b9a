"""How long a checkpoint save stalls the training loop: synchronous vs asynchronous, on one CPU process.

For each mode, several rounds of: one training step, save (model + AdamW state + schedule), then `--steps-after`
steps while an async save copies and writes in the background. Reported per mode (median over rounds):
  blocking  - how long save() held the loop (sync: the whole save; async: collecting the state, starting the copy)
  snapshot  - async: how long the next optimizer step waited for the copy to host memory to finish
  stall     - blocking + snapshot: how long the save held the step loop
  slowdown  - async: extra time of the following steps over the same steps without a save in that round (the
              background threads' share of the CPU); noisy where other processes share the cores
  write     - from the save call until the checkpoint was published

  python benchmarks/checkpoint_bench.py                 # ~370 MB of weights, ~1.1 GB checkpoint
  python benchmarks/checkpoint_bench.py --dim 512 --n-layers 4 --rounds 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from titan_npu import ops
from titan_npu.checkpoint.manager import CheckpointManager
from titan_npu.config.schema import JobConfig
from titan_npu.models.llama import LlamaArgs, Transformer, ffn_hidden_dim


def build(args: argparse.Namespace, ckpt_dir: Path):
    model_args = LlamaArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.dim // 64, n_kv_heads=args.dim // 64,
                           vocab_size=args.vocab, ffn_dim=ffn_hidden_dim(args.dim, 256, None), max_seq_len=args.seq_len)
    torch.manual_seed(0)
    device = torch.device(args.device)
    with device:
        model = Transformer(model_args)
    model.init_weights(buffer_device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    job = JobConfig()
    job.checkpoint.dir = str(ckpt_dir)
    job.checkpoint.keep_last_n = 1
    job.metrics.log_dir = str(ckpt_dir / "logs")
    state = SimpleNamespace(step=0, tokens_seen=0)
    manager = CheckpointManager(job, [model], optimizer, scheduler, None, state, model_args=model_args,
                                device_type=device.type)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
    return model_args, model, optimizer, scheduler, state, manager, tokens


def train_step(model, optimizer, scheduler, state, tokens) -> None:
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    state.step += 1


def timed_steps(n: int, *run) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        train_step(*run)
    if run[-1].device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-after", type=int, default=4, help="steps timed after each save")
    p.add_argument("--device", default="cpu", help="cpu (default), or cuda / npu to time the device-to-host snapshot")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--dir", help="where to write checkpoints (default: a temporary directory)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":
        ops.set_kernels("reference")

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        model_args, model, optimizer, scheduler, state, manager, tokens = build(args, root / "ckpt")
        run = (model, optimizer, scheduler, state, tokens)
        weights_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
        timed_steps(3, *run)  # warm-up; creates the AdamW moments
        columns = ("blocking", "snapshot", "stall", "slowdown", "write")
        results = {mode: {c: [] for c in columns} for mode in ("sync", "async")}
        baseline = []
        # Each round times the same steps without a save, after a sync save and after an async save: a change in
        # the machine's load between rounds affects all three alike.
        for _ in range(args.rounds):
            train_step(*run)
            plain = timed_steps(args.steps_after, *run)
            baseline.append(plain / args.steps_after)
            for mode, rows in results.items():
                train_step(*run)
                manager.last_staging_wait_s = 0.0
                t0 = time.perf_counter()
                manager.save(state.step, sync=mode == "sync")
                blocking = time.perf_counter() - t0
                after = timed_steps(args.steps_after, *run)
                manager.wait()
                write = time.perf_counter() - t0 if mode == "async" else blocking
                snapshot = manager.last_staging_wait_s
                # Not clipped at 0: a negative value is noise, and the median should show it.
                slowdown = after - snapshot - plain if mode == "async" else 0.0
                for key, value in zip(columns, (blocking, snapshot, blocking + snapshot, slowdown, write)):
                    rows[key].append(value)
        base = statistics.median(baseline)
        manager.close()
        ckpt = next((root / "ckpt").glob("step-*"))
        size_gb = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 1e9
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    med = {mode: {k: statistics.median(v) for k, v in rows.items()} for mode, rows in results.items()}
    print(f"{args.device}, model: dim={model_args.dim} layers={model_args.n_layers} vocab={model_args.vocab_size}: "
          f"{weights_mb:.0f} MB of fp32 weights, checkpoint {size_gb:.2f} GB (with AdamW moments); "
          f"baseline step {base:.3f}s; median of {args.rounds} rounds, {torch.get_num_threads()} threads")
    print(f"{'mode':6} " + " ".join(f"{c:>9}" for c in columns))
    for mode, m in med.items():
        print(f"{mode:6} " + " ".join(f"{m[c]:8.2f}s" for c in columns))
    sync_time = med["sync"]["stall"]
    print(f"async holds the step loop for {100 * med['async']['stall'] / sync_time:.1f}% of the sync save time "
          f"({100 * (med['async']['stall'] + med['async']['slowdown']) / sync_time:.1f}% with the slowdown)")
    if args.json:
        Path(args.json).write_text(json.dumps({"weights_mb": weights_mb, "checkpoint_gb": size_gb,
                                               "baseline_step_s": base, "median": med, "rounds": results}, indent=2))


if __name__ == "__main__":
    main()

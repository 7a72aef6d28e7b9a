"""`titan-npu eval`: downstream benchmarks of a checkpoint through lm-evaluation-harness (titan_npu/eval/), offline.

Order: the arguments, the output path and the tasks (their names, data on disk, few-shot pools) are checked before
the model is loaded, so a refusal is quick and writes nothing; the results file is written atomically at the end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from titan_npu.commands.parsing import CommandParser, parse
from titan_npu.errors import CheckpointError, ConfigError

RESULTS_FORMAT = "titan-npu-eval"  # the "format" of a results file this command wrote (what --overwrite may replace)


def build_parser() -> CommandParser:
    p = CommandParser(prog="titan-npu eval",
                      description="Evaluate a checkpoint on lm-evaluation-harness tasks (offline).")
    p.add_argument("--checkpoint", required=True, help="a DCP step dir, a checkpoint.dir (its latest), or a .pt")
    p.add_argument("--tasks", required=True, help="comma-separated task names (shipped: titan_mc, titan_cloze, "
                                                  "titan_corpus; or lm_eval's, e.g. hellaswag,arc_easy)")
    p.add_argument("--config", help="the run's config (default: config.toml beside the checkpoint or its log dir)")
    p.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples of each task")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward")
    p.add_argument("--include-path", action="append", default=[], help="a folder of extra task YAMLs (repeatable)")
    p.add_argument("--output", help="write the results as JSON to this file")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier results file of this command")
    p.add_argument("--tokenizer", help="override the config's data.tokenizer")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="weights' dtype (auto: fp32 on cpu, bf16 on accelerators)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def is_results_file(path: Path) -> bool:
    """True when `path` is a results file this command wrote (a JSON object with its format)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == RESULTS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    """`titan-npu eval --checkpoint DIR --tasks a,b [--num-fewshot N] [--limit N] [--output results.json]`."""
    args, _ = parse("eval", build_parser(), argv)  # ranges from config/options.py, before torch is imported
    from titan_npu import outputs

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError(f"--tasks {args.tasks!r} names no task; give comma-separated names, e.g. titan_mc")
    output = Path(args.output) if args.output else None
    if output is not None:
        outputs.check_file_output("--output", output, args.overwrite, ConfigError, "eval results file",
                                  "is a folder; give a file name such as results.json", ours=is_results_file)
    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        raise CheckpointError(f"--checkpoint {ckpt} does not exist; give a checkpoint directory or a .pt file")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("titan-npu eval needs lm-evaluation-harness: pip install 'titan-npu[eval]'") from None
    from titan_npu.eval.harness import load_tasks, run_tasks, summarize

    loaded = load_tasks(tasks, args.include_path, args.num_fewshot)
    model, tokenizer, ckpt, device = load_checkpoint_model(ckpt, args.config, args.tokenizer, args.dtype)
    from titan_npu.config.schema import CommConfig
    from titan_npu.eval.adapter import TitanLM
    from titan_npu.parallel import destroy_process_group, init_process_group

    # Under torchrun every process holds the whole model and lm_eval splits the requests among them; rank 0 reports.
    rank, _ = init_process_group(device, CommConfig())
    try:
        t0 = time.perf_counter()
        results = run_tasks(TitanLM(model, tokenizer, batch_size=args.batch_size), loaded, args.limit)
        seconds = time.perf_counter() - t0
    finally:
        destroy_process_group()
    if rank != 0:
        return 0
    summary = summarize(results)
    for task, metrics in summary.items():
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
        print(f"{task}: {shown}")
    print(f"[eval: {len(summary)} task(s) in {seconds:.1f}s on {device.type}]", file=sys.stderr)
    if output is not None:
        from titan_npu.atomic import atomic_write_json

        atomic_write_json(output, {
            "format": RESULTS_FORMAT, "checkpoint": str(ckpt), "tasks": tasks, "num_fewshot": args.num_fewshot,
            "limit": args.limit, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "results": summary, "n_samples": results.get("n-samples", {}), "versions": results.get("versions", {}),
            "seconds": round(seconds, 3),
        }, indent=2)
        print(f"wrote {output}", file=sys.stderr)
    return 0


def load_checkpoint_model(ckpt: Path, config: str | None, tokenizer_spec: str | None, dtype: str):
    """(model, tokenizer, checkpoint path, DeviceInfo) of a checkpoint on this process's device: its full weights
    (DCP checkpoints hold no layout), the model its checkpoint.json records, the run's tokenizer."""
    from titan_npu.checkpoint.fit import load_model
    from titan_npu.commands.generate import _dtype, read_for_inference
    from titan_npu.data import build_tokenizer
    from titan_npu.device import setup_device
    from titan_npu.tools.generate import resolve_checkpoint

    ckpt = resolve_checkpoint(ckpt)
    weights, model_args, tokenizer_spec = read_for_inference(ckpt, config, tokenizer_spec, "eval")
    tokenizer = build_tokenizer(tokenizer_spec)
    device = setup_device()
    try:
        model = load_model(weights.state_dict, model_args, device.torch_device, _dtype(dtype, device.type))
    except RuntimeError as e:
        if "allocate" not in str(e).lower() and "out of memory" not in str(e).lower():
            raise
        raise CheckpointError(f"{ckpt}'s full model does not fit in one {device.type}'s memory; titan-npu eval "
                              f"holds the whole model on each process: export it (titan-npu export --format hf) and "
                              f"evaluate it with lm_eval's sharded Hugging Face backend") from None
    if tokenizer.vocab_size > model.output.out_features:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids but the model only "
                          f"{model.output.out_features}; pass the run's tokenizer with --tokenizer")
    return model, tokenizer, ckpt, device

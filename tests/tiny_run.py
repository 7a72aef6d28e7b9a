"""The tiny training run that the checkpoint and reliability tests launch, as train.py arguments.

Imported as `tiny_run`: pytest puts tests/ on sys.path for the test packages (tests/checkpoint, tests/reliability).
"""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

# A ~0.2M-parameter Llama on the built-in corpus: a step takes milliseconds, a whole run a few seconds.
TINY_RUN = [
    "--model.name", "llama3", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
    "--model.n_kv_heads", "2", "--model.vocab_size", "512", "--model.max_seq_len", "64",
    "--training.seq_len", "32", "--training.batch_size", "2", "--training.dtype", "fp32",
    "--training.deterministic", "true", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
    "--data.tokenizer", "byte", "--data.num_workers", "0",
    "--metrics.log_interval", "1", "--metrics.tensorboard", "false", "--metrics.report", "false",
    "--metrics.progress", "lines",
]


def tiny_args(run_dir: Path, **extra: object) -> list[str]:
    """TINY_RUN logging to run_dir/logs and checkpointing to run_dir/ckpt, plus --section.key extras (a__b = a.b)."""
    out = TINY_RUN + ["--metrics.log_dir", str(run_dir / "logs"), "--checkpoint.dir", str(run_dir / "ckpt")]
    for key, value in extra.items():
        out += [f"--{key.replace('__', '.')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` with a digest of its bytes (folders: 'dir'): equal before and after
    means nothing there was changed, added or deleted."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_dir():
            out[rel] = "dir"
        elif p.is_file():
            out[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
        else:  # a FIFO, device or socket a test made: reading it would wait
            out[rel] = f"special {stat.S_IFMT(p.lstat().st_mode):o}"
    return out


def train_tiny(run_dir: Path, steps: int = 1, **extra: object) -> Path:
    """A real tiny training run in this process, saving synchronously at its last step; its checkpoint dir."""
    from titan_npu.cli import main

    assert main(["train", *tiny_args(run_dir, training__max_steps=steps, checkpoint__async_save=False, **extra)]) == 0
    return run_dir / "ckpt"


def refusal_line(capsys, argv: list[str]) -> str:
    """The one stderr line of `titan-npu ARGV` run in-process, asserting exit 2, one line and no traceback."""
    from titan_npu.cli import main as cli_main

    capsys.readouterr()
    assert cli_main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err
    return lines[0]

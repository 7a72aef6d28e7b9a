"""A run on a data mixture resumed from its step-k checkpoint reads the windows the uninterrupted run read, bit for
bit; restarted on 2 gloo ranks after 1, it continues with the same global sequence of windows. Per-source validation
losses equal a hand computation over each source's held-out split."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from ranks import spawn_ranks

from titan_npu.data.loader import split_documents

from .runs import copy_checkpoint, losses, overrides

WEIGHTS = ("0.6", "0.3", "0.1")


def write_sources(tmp: Path) -> list[str]:
    """Three raw-text corpora of different sizes (the byte tokenizer reads them)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    paths = []
    for i, (name, docs) in enumerate((("web", 60), ("code", 30), ("math", 12))):
        path = tmp / f"{name}.txt"
        path.write_text("\n\n".join(f"{name} {j}: " + " ".join(words[(i + j + k) % 8] for k in range(4 + j % 9))
                                    for j in range(docs)) + "\n")
        paths.append(str(path))
    return paths


def mixture_args(tmp: Path, name: str, **extra: object) -> list[str]:
    paths = sorted(str(p) for p in tmp.glob("*.txt"))  # code, math, web
    by_name = {Path(p).stem: p for p in paths}
    spec = [x for w, n in zip(WEIGHTS, ("web", "code", "math")) for x in (w, by_name[n])]
    return [*overrides(tmp, name, **extra), "--data_path", *spec]


def run_recording(args: list[str], out: Path | None = None):
    """Train in this process, recording every batch's input rows; (trainer, rows per step)."""
    from titan_npu import ops
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    ops.set_kernels("reference")
    trainer = Trainer(load_config(None, args))
    rows: list[list[list[int]]] = []
    real = trainer.dataloader

    class Recorder:
        def __iter__(self):
            return self

        def __next__(self):
            batch = next(real)
            rows.append(batch[0].tolist())
            return batch

        def __getattr__(self, name):
            return getattr(real, name)

    trainer.dataloader = Recorder()
    try:
        trainer.train()
    finally:
        trainer.close()
    if out is not None:
        out.write_text(json.dumps(rows))
    return trainer, rows


def test_a_resumed_mixture_reads_the_windows_of_the_uninterrupted_run(tmp_path):
    write_sources(tmp_path)
    save = dict(training__max_steps=8, checkpoint__save_interval=3, checkpoint__async_save=False)
    full, full_rows = run_recording(mixture_args(tmp_path, "full", **save))
    copy_checkpoint(tmp_path, "full", 3, "resumed")
    resumed, resumed_rows = run_recording(mixture_args(tmp_path, "resumed", **save))
    assert resumed_rows == full_rows[3:]
    a, b = losses(tmp_path, "full"), losses(tmp_path, "resumed")
    assert [b[s] for s in range(4, 9)] == [a[s] for s in range(4, 9)]
    assert resumed.dataloader.state_dict() == full.dataloader.state_dict()


def _two_ranks(rank: int, args: list[str], port: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)
    run_recording(args, Path(f"{out}.rank{rank}.json"))


def test_a_mixture_restarted_on_two_ranks_continues_the_global_windows_of_one(tmp_path):
    from titan_npu.parallel.process_group import free_port

    write_sources(tmp_path)
    save = dict(checkpoint__save_interval=3, checkpoint__async_save=False)
    _, one_rank = run_recording(mixture_args(tmp_path, "one", training__max_steps=7, **save))
    copy_checkpoint(tmp_path, "one", 3, "two")
    # 2 ranks of batch_size 2: a step takes 4 windows, two steps of the 1-rank run.
    spawn_ranks(_two_ranks, (mixture_args(tmp_path, "two", training__max_steps=5, **save), free_port(),
                             tmp_path / "rows"), 2)
    ranks = [json.loads(Path(f"{tmp_path / 'rows'}.rank{r}.json").read_text()) for r in range(2)]
    merged = [row for step in range(2) for r in range(2) for row in ranks[r][step]]
    assert merged == [row for step in one_rank[3:7] for row in step]


def test_per_source_validation_equals_a_hand_computation_over_each_held_out_split(tmp_path):
    from titan_npu.config.loader import load_config
    from titan_npu.data.datasets import open_dataset
    from titan_npu.data.tokenizer import build_tokenizer

    write_sources(tmp_path)
    args = mixture_args(tmp_path, "val", training__max_steps=2, data__val_fraction=0.25, validation__enable=True,
                        validation__interval=2, validation__steps=2, checkpoint__enable=False)
    trainer, _ = run_recording(args)
    record = [json.loads(line) for line in (tmp_path / "val" / "logs" / "metrics.jsonl").read_text().splitlines()
              if "val_loss" in line][-1]
    cfg = load_config(None, args)
    seq, rows = cfg.training.seq_len, cfg.validation.steps * cfg.training.batch_size
    tokenizer = build_tokenizer("byte")
    model = trainer.model.eval()
    expected = {}
    for name in ("web", "code", "math"):
        ds = open_dataset(str(tmp_path / f"{name}.txt"), tokenizer)
        held_out = split_documents(ds.num_docs, 0.25, "validation")
        stream = np.concatenate([ds.read(int(d), 0, int(ds.doc_lengths[d])) for d in held_out]).astype(np.int64)
        windows = torch.tensor(np.stack([stream[w * seq : w * seq + seq + 1] for w in range(rows)]))
        with torch.no_grad():
            logits = model(windows[:, :-1])
        expected[name] = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten()).item()
        assert math.isclose(record[f"val_loss/{name}"], expected[name], rel_tol=1e-5), name
        assert math.isclose(record[f"val_ppl/{name}"], math.exp(expected[name]), rel_tol=1e-5)
    mixture = 0.6 * expected["web"] + 0.3 * expected["code"] + 0.1 * expected["math"]
    assert math.isclose(record["val_loss"], mixture, rel_tol=1e-5)


def test_a_mixture_run_killed_at_a_step_resumes_in_a_real_process_with_the_same_losses_and_counts(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    write_sources(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TITAN_FAULT_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(TITAN_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    save = dict(training__max_steps=7, checkpoint__save_interval=2, checkpoint__async_save=False)

    def train(name: str, **fault: str) -> subprocess.CompletedProcess:
        script = str(repo / "tests" / "train_with_faults.py") if fault else "train.py"
        return subprocess.run([sys.executable, script, *mixture_args(tmp_path, name, **save)], cwd=repo,
                              env={**env, **fault}, capture_output=True, text=True, timeout=240)

    assert train("full").returncode == 0
    killed = train("killed", TITAN_FAULT_KILL_AT_STEP="5")
    assert killed.returncode != 0
    assert train("killed").returncode == 0, "the resumed run failed"

    def records(name: str) -> dict[int, dict]:
        lines = (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    full, resumed = records("full"), records("killed")
    for step in (5, 6, 7):
        assert resumed[step]["loss"] == full[step]["loss"]
        assert {k: v for k, v in resumed[step].items() if k.startswith("tokens/")} == \
            {k: v for k, v in full[step].items() if k.startswith("tokens/")}

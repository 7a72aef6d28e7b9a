"""`titan-npu eval` under torchrun: each process holds the whole model, lm_eval splits the requests between them
(data parallel), and rank 0 alone writes the same results a single process gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from eval_checkpoints import tiny_checkpoint

pytest.importorskip("lm_eval")
REPO = Path(__file__).resolve().parents[2]


def _eval(prefix: list[str], ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(TITAN_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    argv = ["-m", "titan_npu.cli", "eval", "--checkpoint", str(ckpt), "--tasks", "titan_mc", "--limit", "7",
            "--batch-size", "3", "--output", str(out)]
    return subprocess.run([*prefix, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
def test_two_processes_split_the_requests_and_report_what_one_process_reports(tmp_path):
    ckpt = tiny_checkpoint(tmp_path, "llama")
    one = _eval([sys.executable], ckpt, tmp_path / "one.json")
    assert one.returncode == 0, one.stderr[-2000:]
    two = _eval([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], ckpt,
                tmp_path / "two.json")
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("titan_mc: acc=") == 1  # rank 0 reports
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert a["results"] == b["results"] and b["n_samples"]["titan_mc"]["effective"] == 7


@pytest.mark.distributed
def test_eval_in_a_two_process_fsdp_run_gathers_the_weights_to_rank_0(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_run import tiny_args

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(TITAN_DEVICE="cpu", OMP_NUM_THREADS="1")
    args = tiny_args(tmp_path, training__max_steps=2, eval__enable=True, eval__interval=2, eval__limit=4,
                     eval__tasks='["titan_mc"]')
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_time_s" in r]
    assert [r["step"] for r in evals] == [2] and 0 <= evals[0]["eval/titan_mc/acc"] <= 1
    assert (run.stdout + run.stderr).count("[Eval 2] titan_mc") == 1
    # The run's FSDP checkpoint (sharded over 2 ranks) is evaluated whole by one process: checkpoints hold no layout.
    from titan_npu.cli import main

    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", "titan_mc", "--limit", "4",
                 "--output", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["results"]["titan_mc"] == \
        {k.split("/")[-1]: v for k, v in evals[0].items() if k.startswith("eval/")}

"""Two "nodes" on one machine: two torchrun launches (--nnodes 2, one process each) meeting through the c10d
rendezvous on loopback train train.py unchanged, with the losses of one process reading both ranks' batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import STEPS, free_port, losses, tiny_run

pytestmark = pytest.mark.distributed

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"


def test_two_node_c10d_rendezvous_run_matches_single_process(parallel_workspace):
    port = free_port()
    env = dict(os.environ, TITAN_DEVICE="cpu", OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=titan-test",
              "--max_restarts=0", str(TRAIN_PY), *tiny_run(parallel_workspace, "two_nodes")]
    nodes = [subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=300)
            outputs.append(out)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-3000:]
    got, want = losses(parallel_workspace, "two_nodes"), losses(parallel_workspace, "ref_b8")
    assert len(got) == STEPS
    assert got == pytest.approx(want, rel=1e-5)

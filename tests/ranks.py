"""Launching gloo ranks for the distributed tests: every rank forks from one server process that has imported torch
and the trainer once per test session (multiprocessing's "forkserver"), instead of importing them anew in each rank
of each pool ("spawn": 2-4 s of imports per rank, dozens of pools per session, on 2 shared cores). A rank is a fresh
process all the same: it shares no state with the test process or with earlier ranks, and it runs with the test
process's environment as it is at launch (the server's own is the one it started with)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What the server imports before it forks any rank: the bulk of a rank's start-up.
PRELOAD = ["torch", "torch.distributed", "titan_npu.trainer"]


def spawn_ranks(fn: Callable[..., None], args: tuple = (), nprocs: int = 2) -> None:
    """fn(rank, *args) in `nprocs` new processes, each with this process's current environment; raises if any rank
    fails (torch.multiprocessing's ProcessRaisedException / ProcessExitedException)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read once, when the server starts (the first launch)
    mp.start_processes(_in_environment, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _in_environment(rank: int, environ: dict[str, str], fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)

"""Tensor parallelism of a MoE model (2 gloo ranks, tp 2, no data parallelism): the experts split on their ffn dim,
the router replicated, a shared expert split as the dense SwiGLU, the MoE input gathered from the sequence shard
and its output reduce-scattered back. After
two backward passes of cross entropy + the aux loss, every parameter's gradient has its parameter's placements and
equals one process's gradient; the aux loss and the routing are one process's. Both models start from the weights
of the same seed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from titan_npu.parallel.process_group import free_port

pytestmark = pytest.mark.distributed

WORLD = 2
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_moe.toml"
# debug_moe shrunk; a large aux coefficient so that the aux loss's share of every router gradient is tested.
OVERRIDES = ["--model.dim=64", "--model.n_layers=2", "--model.moe_ffn_dim=32", "--model.router_aux_loss_coef=1.0",
             "--training.dtype=fp32", "--parallel.tp_degree=2", "--parallel.dp_shard=1"]
# fp32 on one host: the sharded matmuls and reductions only reorder sums.
RTOL, ATOL = 1e-5, 1e-6


# case -> overrides: the loss-parallel and the replicated logits; a shared expert (split as the dense SwiGLU).
CASES = {"loss-parallel": ["--parallel.loss_parallel=true"], "replicated-logits": ["--parallel.loss_parallel=false"],
         "shared-expert": ["--parallel.loss_parallel=true", "--model.shared_ffn_dim=32"]}


def _check(case: str) -> list[str]:
    """Two backward passes (gradient accumulation) under tp 2; the problems found, if any."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from titan_npu.config.loader import load_config
    from titan_npu.models.registry import build_model, build_model_args, spec_of
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.parallelize import materialize
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.loss import cross_entropy_loss

    cfg = load_config(CONFIG, [*OVERRIDES, *CASES[case]])
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    assert dims.tp == WORLD and not dims.dp_enabled, dims.describe()
    dims.build_mesh("cpu")
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = build_model(args)
    model = spec_of(model.args).parallelize(model, dims, cfg)
    materialize(model, torch.device("cpu"), cfg)
    reference = build_model(args)
    reference.init_weights(seed=cfg.training.seed)

    generator = torch.Generator().manual_seed(11)
    problems = []
    for micro in range(2):
        tokens = torch.randint(0, args.vocab_size, (2, 33), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel_context(dims, cfg.parallel.loss_parallel):
            loss = cross_entropy_loss(model(inputs), labels)
            aux = model.auxiliary_loss()
            if isinstance(loss, DTensor):
                aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()], run_check=False)
            (loss + aux).backward()
        (cross_entropy_loss(reference(inputs), labels) + reference.auxiliary_loss()).backward()
        where = f"{case} backward {micro + 1}"
        if not torch.allclose(aux.full_tensor() if isinstance(aux, DTensor) else aux, reference.auxiliary_loss(),
                              rtol=RTOL):
            problems.append(f"{where}: aux loss {float(aux)} != one process's {float(reference.auxiliary_loss())}")
        ours, theirs = model.routing_metrics(), reference.routing_metrics()
        if not torch.equal(ours["expert_tokens"], theirs["expert_tokens"]):
            problems.append(f"{where}: tokens per expert differ from one process's")
        want = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if p.grad is None:
                problems.append(f"{where} {name}: no gradient")
                continue
            if tuple(p.grad.placements) != tuple(p.placements):
                problems.append(f"{where} {name}: gradient placements {p.grad.placements} != parameter "
                                f"{p.placements}")
            full = p.grad.full_tensor()
            if not torch.allclose(full, want[name].grad, rtol=RTOL, atol=ATOL):
                err = (full - want[name].grad).abs().max().item()
                problems.append(f"{where} {name}: gradient differs from one process by up to {err:.3g}")
    return problems


def _worker(rank: int, port: int, workdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)  # both ranks share two cores
    dist.init_process_group("gloo")
    try:
        report = {case: _check(case) for case in CASES}
        (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_tp_report(tmp_path_factory) -> dict[str, list[str]]:
    """Every case run on both ranks (one pool); case -> the problems any rank found."""
    workdir = tmp_path_factory.mktemp("moe_tp")
    mp.spawn(_worker, args=(free_port(), str(workdir)), nprocs=WORLD, join=True)
    report: dict[str, list[str]] = {case: [] for case in CASES}
    for rank in range(WORLD):
        for case, problems in json.loads((workdir / f"rank{rank}.json").read_text()).items():
            report[case] += [f"rank {rank}: {p}" for p in problems]
    return report


@pytest.mark.parametrize("case", list(CASES))
def test_moe_tp_gradients_have_their_parameters_placements_and_one_process_values(moe_tp_report, case):
    problems = moe_tp_report[case]
    assert not problems, "\n".join(problems[:20])

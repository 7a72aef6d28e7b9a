"""Pure tensor parallelism (no data-parallel wrapper after it): after each backward every parameter's gradient has
its parameter's placements, so its local shard shape, and equals the single-process gradient (2 gloo ranks). Both
models start from the weights of the same seed, with no checkpoint between them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from .harness import free_port, model_overrides

pytestmark = pytest.mark.distributed

WORLD = 2
# name: (tiny model of harness.MODELS, overrides on top of tp_degree=2 with dp_shard=1: the tensor-parallel group is
# the whole world). Qwen3: the per-head q/k norm weights, replicated, get the sum of every rank's heads' gradient;
# Qwen2: the q/k/v biases are cut with their columns; both tie the output to the vocab-parallel embedding.
CASES = {
    "tp2": ("llama3", []),
    "tp2_replicated_logits": ("llama3", ["--parallel.loss_parallel=false"]),
    "tp2_ac_selective_ops": ("llama3", ["--activation_checkpoint.mode=selective",
                                        "--activation_checkpoint.selective_ops=true"]),
    "qwen3_tp2": ("qwen3", []),
    "qwen3_tp2_replicated_logits_ac_selective_ops": ("qwen3", ["--parallel.loss_parallel=false",
                                                               "--activation_checkpoint.mode=selective",
                                                               "--activation_checkpoint.selective_ops=true"]),
    "qwen2_tp2": ("qwen2", []),
}
# fp32 on one host: the sharded matmuls and reductions only reorder sums.
RTOL, ATOL = 1e-5, 1e-6


def _overrides(model: str, extra: list[str]) -> list[str]:
    return model_overrides(model) + ["--training.dtype=fp32", "--parallel.tp_degree=2", "--parallel.dp_shard=1",
                                     *extra]


def _check_case(name: str, model_name: str, extra: list[str]) -> list[str]:
    """Two backward passes (gradient accumulation) under this case's layout; the problems found, if any."""
    import torch.distributed as dist

    from titan_npu.config.loader import load_config
    from titan_npu.models.registry import build_model, build_model_args, spec_of
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.parallelize import materialize
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.loss import cross_entropy_loss

    cfg = load_config(None, _overrides(model_name, extra))
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
            cross_entropy_loss(model(inputs), labels).backward()
        cross_entropy_loss(reference(inputs), labels).backward()
        want = dict(reference.named_parameters())
        for param_name, p in model.named_parameters():
            param_name = param_name.replace("_checkpoint_wrapped_module.", "")
            where = f"{name} backward {micro + 1} {param_name}"
            if p.grad is None:
                problems.append(f"{where}: no gradient")
                continue
            if tuple(p.grad.placements) != tuple(p.placements):
                problems.append(f"{where}: gradient placements {p.grad.placements} != parameter {p.placements}")
            if p.grad.to_local().shape != p.to_local().shape:
                problems.append(f"{where}: local gradient {list(p.grad.to_local().shape)} != shard "
                                f"{list(p.to_local().shape)}")
            full = p.grad.full_tensor()
            if not torch.allclose(full, want[param_name].grad, rtol=RTOL, atol=ATOL):
                err = (full - want[param_name].grad).abs().max().item()
                problems.append(f"{where}: gradient differs from one process by up to {err:.3g}")
    return problems


def _worker(rank: int, port: int, workdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)  # both ranks share two cores
    dist.init_process_group("gloo")
    try:
        report = {name: _check_case(name, model, extra) for name, (model, extra) in CASES.items()}
        (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_gradient_report(tmp_path_factory) -> dict[str, list[str]]:
    """Every case run on both ranks (one pool); case name -> the problems any rank found."""
    workdir = tmp_path_factory.mktemp("tp_gradients")
    mp.spawn(_worker, args=(free_port(), str(workdir)), nprocs=WORLD, join=True)
    report: dict[str, list[str]] = {name: [] for name in CASES}
    for rank in range(WORLD):
        for name, problems in json.loads((workdir / f"rank{rank}.json").read_text()).items():
            report[name] += [f"rank {rank}: {p}" for p in problems]
    return report


@pytest.mark.parametrize("name", list(CASES))
def test_pure_tp_gradients_have_their_parameters_placements_and_values(tp_gradient_report, name):
    problems = tp_gradient_report[name]
    assert not problems, "\n".join(problems[:20])

"""Expert parallelism of the MoE layer (models/moe/dispatch.py) on 2 gloo ranks: each rank routes half of the
tokens, holds half of the experts as a DTensor shard and exchanges its tokens with the other; the outputs, every
expert's gradient and the router's equal one process's over all the tokens, eager and compiled; with a capacity
factor (the fixed-size exchange) they equal one process's run of each rank's tokens as its own forward."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks

from titan_npu.parallel.process_group import free_port

pytestmark = pytest.mark.distributed

WORLD = 2
TOKENS = 24  # over both ranks
RTOL, ATOL = 1e-5, 1e-6  # fp32 on one host: the exchange only moves rows, the sums are reordered


def _moe(capacity_factor: float | None = None):
    from titan_npu.models.moe.args import MoEArgs
    from titan_npu.models.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(MoEArgs(dim=16, n_experts=6, top_k=2, ffn_dim=8, capacity_factor=capacity_factor))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over the tokens, as the cross entropy is: each rank's mean, averaged over ranks, is one process's."""
    return (out * target).sum(-1).pow(2).mean()


def _check(rank: int, compiled: bool, capacity_factor: float | None = None) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titan_npu.models.moe.parallelize import apply_expert_parallel

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, 16, generator=generator)
    target = torch.randn(TOKENS, 16, generator=generator)
    halves = [slice(r * TOKENS // WORLD, (r + 1) * TOKENS // WORLD) for r in range(WORLD)]
    mine = halves[rank]

    reference = _moe(capacity_factor)
    ref_x = x.clone().requires_grad_()
    if capacity_factor is None:
        ref_out, _ = reference(ref_x)
    else:  # a capacity caps each forward's tokens: one process runs each rank's half as its own forward
        runs = [reference(ref_x[half]) for half in halves]
        ref_out, ref_dropped = torch.cat([out for out, _ in runs]), runs[rank][1][2]
    _loss(ref_out, target).backward()

    moe = _moe(capacity_factor)
    apply_expert_parallel(moe, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",)))
    if compiled:
        moe.compile()  # as compile.enable does per block: the split sizes' host read breaks the graph there
    local_x = x[mine].clone().requires_grad_()
    out, (counts, _, dropped) = moe(local_x)
    _loss(out, target[mine]).backward()

    problems = []

    def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            problems.append(f"{what}: differs from one process by up to {(got - want).abs().max().item():.3g}")

    compare("output", out, ref_out[mine].detach())
    # This rank's loss is the mean over half the tokens: its input gradient is WORLD x one process's.
    compare("input gradient", local_x.grad / WORLD, ref_x.grad[mine])
    for name in ("w1", "w2", "w3"):
        param = getattr(moe.experts, name)
        if param.to_local().shape[0] != 6 // WORLD:
            problems.append(f"experts.{name}: holds {param.to_local().shape[0]} experts, not {6 // WORLD}")
        compare(f"experts.{name} gradient", param.grad.full_tensor(), getattr(reference.experts, name).grad)
    router_grad = moe.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)  # the data-parallel mean FSDP takes
    compare("router gradient", router_grad / WORLD, reference.router.gate.weight.grad)
    if counts.sum().item() != TOKENS // WORLD * 2:
        problems.append(f"routing counts cover {counts.sum().item()} assignments, not this rank's tokens x top_k")
    if capacity_factor is not None and not (dropped.item() == ref_dropped.item() > 0):
        problems.append(f"dropped {dropped.item()} assignments, one process {ref_dropped.item()} (must be > 0)")
    return problems


def _worker(rank: int, port: int, workdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)  # both ranks share two cores
    dist.init_process_group("gloo")
    try:
        # Capacity 0.5: ceil(0.5 x 12 x 2 / 6) = 2 slots per expert and rank, exchanged at fixed sizes.
        cases = (("eager", False, None), ("compiled", True, None), ("capacity 0.5", False, 0.5))
        problems = [f"{mode}: {p}" for mode, compiled, capacity in cases for p in _check(rank, compiled, capacity)]
        (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(problems))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_layer_gives_one_process_outputs_and_every_expert_gradient_eager_compiled_and_capped(
        tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD)
    problems = [f"rank {r}: {p}" for r in range(WORLD) for p in json.loads((tmp_path / f"rank{r}.json").read_text())]
    assert not problems, "\n".join(problems)

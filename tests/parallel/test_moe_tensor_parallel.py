"""Tensor parallelism of a MoE model (2 gloo ranks, tp 2, no data parallelism): the experts split on their ffn dim,
the router replicated, a shared expert split as the dense SwiGLU, the MoE input gathered from the sequence shard
and its output reduce-scattered back. After
two backward passes of cross entropy + the aux loss, every parameter's gradient has its parameter's placements and
equals one process's gradient; the aux loss and the routing are one process's. Both models start from the weights
of the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .harness import gradient_problems, rank_reports, tensor_parallel_pair

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
    from torch.distributed.tensor import DTensor, Replicate

    from titan_npu.config.loader import load_config
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.loss import cross_entropy_loss

    cfg = load_config(CONFIG, [*OVERRIDES, *CASES[case]])
    model, reference, dims = tensor_parallel_pair(cfg)
    generator = torch.Generator().manual_seed(11)
    problems = []
    for micro in range(2):
        tokens = torch.randint(0, reference.args.vocab_size, (2, 33), generator=generator)
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
        problems += gradient_problems(where, model, reference, RTOL, ATOL)
    return problems


@pytest.fixture(scope="module")
def moe_tp_report(tmp_path_factory) -> dict[str, list[str]]:
    """Every case run on both ranks (one pool); case -> the problems any rank found."""
    return rank_reports(WORLD, _check, list(CASES), tmp_path_factory.mktemp("moe_tp"))


@pytest.mark.parametrize("case", list(CASES))
def test_moe_tp_gradients_have_their_parameters_placements_and_one_process_values(moe_tp_report, case):
    problems = moe_tp_report[case]
    assert not problems, "\n".join(problems[:20])

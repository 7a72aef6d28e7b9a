"""Pure tensor parallelism (no data-parallel wrapper after it): after each backward every parameter's gradient has
its parameter's placements, so its local shard shape, and equals the single-process gradient (2 gloo ranks). Both
models start from the weights of the same seed, with no checkpoint between them."""

from __future__ import annotations

import pytest
import torch

from .harness import gradient_problems, model_overrides, rank_reports, tensor_parallel_pair

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


def _check_case(name: str) -> list[str]:
    """Two backward passes (gradient accumulation) under this case's layout; the problems found, if any."""
    from titan_npu.config.loader import load_config
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.loss import cross_entropy_loss

    model_name, extra = CASES[name]
    cfg = load_config(None, _overrides(model_name, extra))
    model, reference, dims = tensor_parallel_pair(cfg)
    generator = torch.Generator().manual_seed(11)
    problems = []
    for micro in range(2):
        tokens = torch.randint(0, reference.args.vocab_size, (2, 33), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel_context(dims, cfg.parallel.loss_parallel):
            cross_entropy_loss(model(inputs), labels).backward()
        cross_entropy_loss(reference(inputs), labels).backward()
        problems += gradient_problems(f"{name} backward {micro + 1}", model, reference, RTOL, ATOL)
    return problems


@pytest.fixture(scope="module")
def tp_gradient_report(tmp_path_factory) -> dict[str, list[str]]:
    """Every case run on both ranks (one pool); case name -> the problems any rank found."""
    return rank_reports(WORLD, _check_case, list(CASES), tmp_path_factory.mktemp("tp_gradients"))


@pytest.mark.parametrize("name", list(CASES))
def test_pure_tp_gradients_have_their_parameters_placements_and_values(tp_gradient_report, name):
    problems = tp_gradient_report[name]
    assert not problems, "\n".join(problems[:20])

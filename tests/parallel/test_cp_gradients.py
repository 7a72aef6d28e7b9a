"""Context parallel 2 (2 gloo ranks, FSDP over the cp ranks; 4 ranks with tensor parallel 2) of each family --
Llama 3, Qwen3 (q/k norms, a head size apart from dim / n_heads, tied embeddings), Qwen2 (q/k/v biases), Qwen3-MoE
(its load-balancing loss included) -- with ring attention, of Llama 3, Qwen3 and Qwen3-MoE with Ulysses attention,
and of Llama 3 (ring) and Qwen3 (Ulysses) at cp 2 x tp 2, gives every parameter the gradient one process gets on
the whole sequences, over two backward passes (gradient accumulation), within fp32 tolerance. Both models start
from the weights of the same seed. A pipeline's per-microbatch loss weighting under CP (token_weighted_loss: the local
valid labels over the step's) makes the cp ranks' losses add up to the microbatch's mean, ignored labels included
(a rank with none of them valid adds 0)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from .harness import parallel_pair, run_pool

pytestmark = pytest.mark.distributed

CP = 2
SMALL = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.vocab_size=512", "--model.max_seq_len=64"]
FAMILIES = {
    "llama3": ["--model.name=llama3", *SMALL],
    "qwen3": ["--model.name=qwen3", "--model.flavor=debug", *SMALL, "--model.head_dim=32"],
    "qwen2": ["--model.name=qwen2", "--model.flavor=debug", *SMALL],
}
# Qwen3-MoE with its load-balancing loss weighted 1 (pooled over the cp ranks' tokens), under both modes.
FAMILIES["qwen3_moe"] = ["--model.name=qwen3_moe", "--model.flavor=debug", *SMALL, "--model.head_dim=32",
                         "--model.router_aux_loss_coef=1.0"]
FAMILIES.update({f"{name}_ulysses": [*FAMILIES[name], "--parallel.cp_mode=ulysses"]
                 for name in ("llama3", "qwen3", "qwen3_moe")})
# Context parallel 2 x tensor parallel 2 (4 ranks): the tp ranks split the heads (and, sequence-parallel, the cp
# chunk), the cp ranks' ring or all-to-all runs on each tp rank's heads.
TP_FAMILIES = {f"{name}_tp2": [*FAMILIES[name], "--parallel.tp_degree=2"] for name in ("llama3", "qwen3_ulysses")}
WORLDS = {CP: FAMILIES, 2 * CP: TP_FAMILIES}
RTOL, ATOL = 1e-5, 1e-6


def _auxiliary(model: torch.nn.Module) -> torch.Tensor | float:
    """The auxiliary loss of the model's last forward (a MoE model's load balancing), else 0."""
    aux = model.auxiliary_loss() if hasattr(model, "auxiliary_loss") else None
    return 0.0 if aux is None else aux


def _check_family(name: str, overrides: list[str]) -> list[str]:
    """Two backward passes under cp 2 and on one process; the gradients that differ, if any."""

    from titan_npu.config.loader import load_config
    from titan_npu.parallel.context_parallel import ContextParallelBatch
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.loss import cross_entropy_loss, token_weight, valid_labels

    cfg = load_config(None, [*overrides, "--training.dtype=fp32", f"--parallel.cp_degree={CP}"])
    model, reference, dims = parallel_pair(cfg)

    batch = ContextParallelBatch(*dims.cp_coordinates())
    generator = torch.Generator().manual_seed(11)
    for _ in range(2):
        tokens = torch.randint(0, reference.args.vocab_size, (2, 33), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        local_inputs, local_labels = batch.split(inputs, labels)
        weight = token_weight(valid_labels(local_labels), CP, valid_labels(labels))  # 1: every label is valid
        with loss_parallel_context(dims, cfg.parallel.loss_parallel):  # vocab-sharded logits under TP
            (cross_entropy_loss(model(local_inputs), local_labels) * weight + _auxiliary(model)).backward()
        (cross_entropy_loss(reference(inputs), labels) + _auxiliary(reference)).backward()
    want = dict(reference.named_parameters())
    problems = []
    for param_name, p in model.named_parameters():
        if p.grad is None:
            problems.append(f"{name} {param_name}: no gradient")
            continue
        full = p.grad.full_tensor()
        if not torch.allclose(full, want[param_name].grad, rtol=RTOL, atol=ATOL):
            err = (full - want[param_name].grad).abs().max().item()
            problems.append(f"{name} {param_name}: gradient differs from one process by up to {err:.3g}")
    if set(dict(model.named_parameters())) != set(want):
        problems.append(f"{name}: parameters {sorted(set(want) ^ set(dict(model.named_parameters())))} differ")
    return problems


def _check_pipeline_loss_weight() -> list[str]:
    """A pipeline's last stage weights each microbatch's local mean loss by its valid labels over the step's
    (token_weighted_loss, the cp ranks' share): with ignored labels spread unevenly over the chunks, the cp ranks'
    mean of the weighted losses is the whole microbatch's mean loss; rank 1's chunks, all ignored, add 0 (finite)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from titan_npu.ops.cross_entropy import IGNORE_INDEX
    from titan_npu.parallel.context_parallel import ContextParallelBatch
    from titan_npu.trainer.loss import token_weighted_loss, valid_labels

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    generator = torch.Generator().manual_seed(5)
    logits, labels = torch.randn(2, 16, 8, generator=generator), torch.randint(0, 8, (2, 16), generator=generator)
    labels[0, :3] = IGNORE_INDEX  # some of rank 0's first chunk
    labels[:, 4:12] = IGNORE_INDEX  # every label of rank 1 (chunks 1 and 2 of 4)
    batch = ContextParallelBatch(dist.get_rank(), CP)
    local_logits, local_labels = batch.split(logits, labels)
    got = token_weighted_loss(loss_fn, CP, lambda: valid_labels(labels))(local_logits, local_labels)
    mean = got.clone()
    dist.all_reduce(mean)
    problems = []
    if not torch.isfinite(got):
        problems.append(f"weighted local loss {got.item()} is not finite")
    if dist.get_rank() == 1 and got.item() != 0:
        problems.append(f"rank 1 holds no valid label, yet its weighted loss is {got.item()}")
    if not torch.allclose(mean / CP, loss_fn(logits, labels), rtol=RTOL, atol=ATOL):
        problems.append(f"cp mean {mean.item() / CP} != the microbatch's loss {loss_fn(logits, labels).item()}")
    return problems


def _report(workdir: Path, world: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    report = {name: _check_family(name, overrides) for name, overrides in WORLDS[world].items()}
    if world == CP:
        report["pipeline_loss_weight"] = _check_pipeline_loss_weight()
    (workdir / f"world{world}_rank{dist.get_rank()}.json").write_text(json.dumps(report))


def _gradient_report(workdir: Path, world: int) -> dict[str, list[str]]:
    """The families of `world` ranks run in one pool; family -> the problems any rank found."""
    run_pool(world, [partial(_report, workdir, world)])
    report: dict[str, list[str]] = {}
    for rank in range(world):
        for name, problems in json.loads((workdir / f"world{world}_rank{rank}.json").read_text()).items():
            report[name] = report.get(name, []) + [f"rank {rank}: {p}" for p in problems]
    return report


@pytest.fixture(scope="module")
def cp_gradient_report(tmp_path_factory) -> dict[str, list[str]]:
    """Every family at cp 2 on 2 ranks (one pool); family -> the problems any rank found."""
    return _gradient_report(tmp_path_factory.mktemp("cp_gradients"), CP)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_context_parallel_gradients_equal_the_unsplit_model(cp_gradient_report, family):
    problems = cp_gradient_report[family]
    assert not problems, "\n".join(problems[:20])


def test_a_pipeline_microbatch_loss_is_weighted_by_its_labels_over_the_cp_ranks(cp_gradient_report):
    problems = cp_gradient_report["pipeline_loss_weight"]
    assert not problems, "\n".join(problems)


@pytest.mark.slow  # a 4-rank pool; cp 2 x tp 2 losses equal one process's in the default run (test_loss_parity_cp)
def test_context_parallel_with_tensor_parallel_gradients_equal_the_unsplit_model(tmp_path):
    report = _gradient_report(tmp_path, 2 * CP)
    problems = [p for family in TP_FAMILIES for p in report[family]]
    assert not problems, "\n".join(problems[:20])

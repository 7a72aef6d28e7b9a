"""Pure tensor parallelism (no data-parallel wrapper after it): after each backward every parameter's gradient has
its parameter's placements, so its local shard shape, and equals the single-process gradient (2 gloo ranks). Both
models start from the weights of the same seed, with no checkpoint between them. One case runs on the fake
torch_npu's kernels (tests/npu/fake_torch_npu): the norms, whose inputs are DTensors under sequence parallelism,
run npu_rms_norm on their local shards -- the fake counts every call -- with the same gradients."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

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
# On the fake torch_npu with the npu kernels chosen (both models): the kernel calls of one forward of the tp model.
# Qwen3's 4 blocks: attention_norm, ffn_norm and the per-head q/k norms (DTensors sharded on the sequence or the
# heads), then the final norm; attention, RoPE (q and k) and SwiGLU on the column-parallel layers' local outputs.
NPU_KERNEL_CASES = {"qwen3_tp2_npu_kernels": {"npu_rms_norm": 4 * 4 + 1, "npu_fusion_attention": 4,
                                              "npu_rotary_mul": 2 * 4, "npu_swiglu": 4}}
CASES.update({name: ("qwen3", []) for name in NPU_KERNEL_CASES})
FAKE_TORCH_NPU = Path(__file__).resolve().parents[1] / "npu" / "fake_torch_npu"
# fp32 on one host: the sharded matmuls and reductions only reorder sums.
RTOL, ATOL = 1e-5, 1e-6


@contextlib.contextmanager
def _fake_npu_kernels(active: bool):
    """The fake torch_npu imported and the npu kernels chosen for every tensor (when active); undone after."""
    if not active:
        yield None
        return
    from titan_npu.ops import set_kernels

    sys.path.insert(0, str(FAKE_TORCH_NPU))
    import torch_npu

    set_kernels("npu")
    try:
        yield torch_npu
    finally:
        set_kernels("auto")
        sys.path.remove(str(FAKE_TORCH_NPU))
        for module in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
            del sys.modules[module]
        if hasattr(torch, "npu"):
            delattr(torch, "npu")


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
    with _fake_npu_kernels(name in NPU_KERNEL_CASES) as torch_npu:
        for micro in range(2):
            tokens = torch.randint(0, reference.args.vocab_size, (2, 33), generator=generator)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            with loss_parallel_context(dims, cfg.parallel.loss_parallel):
                if torch_npu is not None:
                    torch_npu.calls.clear()
                logits = model(inputs)
                if torch_npu is not None:
                    calls = {op: torch_npu.calls[op] for op in NPU_KERNEL_CASES[name]}
                    if calls != NPU_KERNEL_CASES[name]:
                        problems.append(f"{name} forward {micro + 1}: kernel calls {calls}, want "
                                        f"{NPU_KERNEL_CASES[name]} (fewer: a DTensor took the reference)")
                cross_entropy_loss(logits, labels).backward()
            cross_entropy_loss(reference(inputs), labels).backward()
            problems += gradient_problems(f"{name} backward {micro + 1}", model, reference, RTOL, ATOL)
        if torch_npu is not None:
            problems += _ops_on_dtensors(name, dims.tp_mesh, torch_npu)
    return problems


def _ops_on_dtensors(name: str, mesh, torch_npu) -> list[str]:
    """Attention split on heads, RoPE on the batch and SwiGLU on its last dim, as DTensors: each runs its kernel on
    the local shards and gives the reference's values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_npu import ops
    from titan_npu.ops import reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 6, heads, 8, generator=g) for heads in (4, 2, 2))
    cos, sin = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    gate, up = torch.randn(2, 2, 6, 8, generator=g)

    def shard(t: torch.Tensor, dim: int):
        return distribute_tensor(t, mesh, [Shard(dim)])

    checks = {
        "npu_fusion_attention": (lambda: ops.attention(shard(q, 2), shard(k, 2), shard(v, 2)),
                                 lambda: reference.attention(q, k, v)),
        "npu_rotary_mul": (lambda: ops.apply_rotary_emb(shard(q, 0), shard(k, 0), cos, sin),
                           lambda: reference.apply_rotary_emb(q, k, cos, sin)),
        "npu_swiglu": (lambda: ops.swiglu(shard(gate, 2), shard(up, 2)), lambda: reference.swiglu(gate, up)),
    }
    problems = []
    for kernel, (on_shards, want) in checks.items():
        torch_npu.calls.clear()
        try:
            got, expected = on_shards(), want()
        except Exception as e:  # the reference on DTensors may lack a sharding rule: report it as this case's problem
            problems.append(f"{name}: {kernel}'s op on DTensors raised {type(e).__name__}: {e}")
            continue
        got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
        if torch_npu.calls[kernel] == 0:
            problems.append(f"{name}: {kernel} did not run on the DTensors' shards")
        for a, b in zip(got, expected, strict=True):
            if not torch.allclose(a.full_tensor(), b, rtol=RTOL, atol=ATOL):
                problems.append(f"{name}: {kernel} on shards differs from the reference")
    return problems


@pytest.fixture(scope="module")
def tp_gradient_report(tmp_path_factory) -> dict[str, list[str]]:
    """Every case run on both ranks (one pool); case name -> the problems any rank found."""
    return rank_reports(WORLD, _check_case, list(CASES), tmp_path_factory.mktemp("tp_gradients"))


@pytest.mark.parametrize("name", list(CASES))
def test_pure_tp_gradients_have_their_parameters_placements_and_values(tp_gradient_report, name):
    problems = tp_gradient_report[name]
    assert not problems, "\n".join(problems[:20])

"""Document masking (data.document_mask, data.reset_position_ids): attention stops at the documents of a packed
window. A token's output does not change when the other documents of its window change, in one process and under
context parallelism (ring and Ulysses, cp 2); the masked model equals the same documents run one by one; ring
attention with documents on the NPU block kernels (fake torch_npu) equals masked SDPA; and a cp 2 run with masking
gives one process's per-step losses and validation loss (fp32, 1e-5 relative)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_npu.models.llama import LlamaArgs, Transformer
from titan_npu.ops.documents import Documents
from titan_npu.parallel.context_parallel import shard_sequence

from .harness import losses, run_pool, tiny_run, write_tokens

SEQ = 32
STEPS = 3
RTOL = 1e-5
# Row 0: documents [0, 7), [7, 20), [20, 32); row 1: [0, 13), [13, 32) -- boundaries inside chunks and at none.
STARTS = [np.array([7, 20]), np.array([0, 13, SEQ])]
BOUNDS = [[0, 7, 20, SEQ], [0, 13, SEQ]]


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=160, max_seq_len=64,
                     rope_theta=10000.0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _with_first_document_changed(tokens: torch.Tensor) -> torch.Tensor:
    """The batch with other tokens in each row's first document."""
    changed = tokens.clone()
    for row, bounds in enumerate(BOUNDS):
        changed[row, : bounds[1]] = _tokens(99)[row, : bounds[1]]
    return changed


def _later_documents(x: torch.Tensor) -> list[torch.Tensor]:
    """Each row's positions after its first document."""
    return [x[row, bounds[1]:] for row, bounds in enumerate(BOUNDS)]


@pytest.mark.parametrize("reset_positions", [False, True], ids=["positions", "reset_positions"])
def test_a_tokens_output_does_not_change_when_the_other_documents_change(reset_positions):
    model, documents = _model(), Documents.from_starts(STARTS, SEQ, reset_positions)
    tokens = _tokens(0)
    with torch.no_grad():
        before = model(tokens, documents=documents)
        after = model(_with_first_document_changed(tokens), documents=documents)
        unmasked = model(_with_first_document_changed(tokens))
    for a, b, c in zip(_later_documents(before), _later_documents(after), _later_documents(model(tokens).detach()),
                       strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(a, c, atol=1e-3)  # the mask is what keeps them apart
    assert not torch.allclose(model(tokens).detach(), unmasked)


def test_the_masked_model_equals_the_same_documents_run_separately():
    model, documents = _model(), Documents.from_starts(STARTS, SEQ, reset_positions=True)
    tokens = _tokens(0)
    with torch.no_grad():
        packed = model(tokens, documents=documents)
        for row, bounds in enumerate(BOUNDS):
            for lo, hi in zip(bounds, bounds[1:]):
                alone = model(tokens[row:row + 1, lo:hi])[0]
                torch.testing.assert_close(packed[row, lo:hi], alone, rtol=1e-5, atol=1e-5)


def _check_context_parallel(workdir: Path, mode: str, reset_positions: bool) -> None:
    """Under cp = world size: each rank's logits of its chunks equal one process's masked logits there, and stay
    put where the other documents change; a file in workdir says the rank got through."""
    import torch.distributed as dist

    from titan_npu.parallel.context_parallel import context_for

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, documents = _model(), Documents.from_starts(STARTS, SEQ, reset_positions)
    tokens, changed = _tokens(0), _with_first_document_changed(_tokens(0))
    with torch.no_grad():
        want = shard_sequence(model(tokens, documents=documents), rank, cp)
        for layer in model.layers.values():
            layer.attention.context = context_for(mode, dist.group.WORLD)
        got = model(shard_sequence(tokens, rank, cp), documents=documents)
        got_changed = model(shard_sequence(changed, rank, cp), documents=documents)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{mode} rank {rank}: {m}")
    later = shard_sequence(torch.stack([torch.arange(SEQ) >= bounds[1] for bounds in BOUNDS]), rank, cp)
    torch.testing.assert_close(got_changed[later], got[later], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got_changed[~later], got[~later], atol=1e-3)
    (workdir / f"checked_{mode}_{reset_positions}_rank{rank}").touch()


def _check_ring_on_npu_blocks(workdir: Path) -> None:
    """Ring attention with documents on the NPU block kernels (the fake torch_npu on CPU tensors, installed for this
    check): the output and dq, dk, dv equal masked SDPA on the whole sequence."""
    import sys

    import torch.distributed as dist

    from titan_npu.ops import attention_blocks, reference
    from titan_npu.parallel.ring_attention import ring_attention

    sys.path.insert(0, str(Path(__file__).parents[1] / "npu" / "fake_torch_npu"))
    import torch_npu  # noqa: F401  (the fake: npu_fusion_attention and its grad on the CPU)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    documents = Documents.from_starts(STARTS, SEQ, reset_positions=False)
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, SEQ, h, 16, generator=g) for h in (4, 2, 2, 4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*whole, documents=documents)
    want.backward(dout)
    local = [shard_sequence(t, rank, cp).requires_grad_() for t in (q, k, v)]
    choose = attention_blocks.block_kernels
    attention_blocks.block_kernels = lambda device_type: choose("npu")
    try:
        out = ring_attention(*local, dist.group.WORLD, documents)
        out.backward(shard_sequence(dout, rank, cp))
    finally:
        attention_blocks.block_kernels = choose
    for got, expected in zip((out, *(t.grad for t in local)), (want, *(t.grad for t in whole)), strict=True):
        torch.testing.assert_close(got.detach(), shard_sequence(expected.detach(), rank, cp), rtol=1e-5, atol=2e-6)
    assert torch_npu.calls["npu_fusion_attention_grad"] == cp  # one block per ring step
    (workdir / f"checked_npu_blocks_rank{rank}").touch()


CHECKS = [(mode, reset) for mode in ("ring", "ulysses") for reset in (False, True)]
# Validation at the last step on 2 held-out batches: the validation loader carries documents too.
MASKED = ["--data.document_mask=true", "--data.reset_position_ids=true", f"--training.max_steps={STEPS}",
          "--validation.enable=true", f"--validation.interval={STEPS}", "--validation.steps=2",
          "--data.val_fraction=0.1"]
RUNS = {"masked_cp2_ring": ["--parallel.cp_degree=2"],
        "masked_cp2_ulysses": ["--parallel.cp_degree=2", "--parallel.cp_mode=ulysses"]}


@pytest.fixture(scope="module")
def masked_runs(tmp_path_factory) -> Path:
    """One process and cp 2 (ring, Ulysses) with document masking, and the model-level checks, in one 2-rank pool."""
    workdir = tmp_path_factory.mktemp("document_mask")
    write_tokens(workdir / "tokens.jsonl")
    checks = [partial(_check_context_parallel, workdir, mode, reset) for mode, reset in CHECKS]
    # The NPU check last: it imports the fake torch_npu into the pool's processes.
    run_pool(2, [*checks, *[tiny_run(workdir, name) + MASKED + extra for name, extra in RUNS.items()],
                 partial(_check_ring_on_npu_blocks, workdir)])
    run_pool(1, [tiny_run(workdir, "masked_one_process") + MASKED])
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "reset"), CHECKS)
def test_context_parallel_attention_stops_at_documents_like_one_process(masked_runs, mode, reset):
    # _check_context_parallel compared each rank's logits (an assertion there fails the pool and this fixture).
    assert all((masked_runs / f"checked_{mode}_{reset}_rank{rank}").exists() for rank in range(2))


@pytest.mark.distributed
def test_ring_attention_with_documents_on_the_npu_block_kernels_equals_masked_sdpa(masked_runs):
    # _check_ring_on_npu_blocks compared each rank's output and gradients (an assertion there fails the pool).
    assert all((masked_runs / f"checked_npu_blocks_rank{rank}").exists() for rank in range(2))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_masked_context_parallel_losses_match_one_process(masked_runs, name):
    want = losses(masked_runs, "masked_one_process")
    assert len(want) == STEPS
    assert losses(masked_runs, name) == pytest.approx(want, rel=RTOL)
    want_val = _validation_losses(masked_runs, "masked_one_process")
    assert len(want_val) == 1 and _validation_losses(masked_runs, name) == pytest.approx(want_val, rel=RTOL)


def _validation_losses(workdir: Path, name: str) -> list[float]:
    lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
    return [r["val_loss"] for r in map(json.loads, filter(str.strip, lines)) if "val_loss" in r]

"""With labels masked as supervised fine-tuning masks them (about 70% -100, micro-batches of very different valid
counts, tests/masked_labels.py), one process's training step optimises the mean cross entropy over the valid labels
of the whole step: its logged loss and its gradients equal plain torch's sum(CE over valid labels) / count on the
step's batch (fp32, 1e-5), the same whether the step is one micro-batch of 4 sequences or 4 accumulated ones of 1,
and the logged `loss_tokens` is that count. A micro-batch without a valid label adds nothing (no NaN)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from masked_labels import MaskedLoader
from tiny_run import tiny_args

from titan_npu.config.loader import load_config
from titan_npu.ops.cross_entropy import IGNORE_INDEX
from titan_npu.trainer import Trainer

STEPS = 3
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _single_process(monkeypatch, one_thread):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


def _masked_run(run_dir: Path, batch_size: int, accum: int) -> tuple[list[dict], MaskedLoader, torch.nn.Module,
                                                                      dict[str, torch.Tensor]]:
    """STEPS steps of the tiny run on masked labels (no clipping): its training records, the loader (the batches it
    gave), the model as it started and the gradients of the first step."""
    cfg = load_config(None, tiny_args(run_dir, training__max_steps=STEPS, training__batch_size=batch_size,
                                      training__gradient_accumulation_steps=accum, training__max_norm=0,
                                      training__seq_len=16, checkpoint__enable=False))
    trainer = Trainer(cfg)
    loader = trainer.dataloader = MaskedLoader(trainer.dataloader)
    start = copy.deepcopy(trainer.model)
    grads: dict[str, torch.Tensor] = {}

    def first_gradients(optimizer, args, kwargs) -> None:
        if not grads:
            grads.update({name: p.grad.clone() for name, p in trainer.model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(first_gradients)
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r], loader, start, grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple]:
    """accumulation steps -> the masked run with a step of 4 sequences as 4 // accum x accum."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("TITAN_DEVICE", "cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return {accum: _masked_run(tmp_path_factory.mktemp(f"accum{accum}"), 4 // accum, accum)
                    for accum in (1, 4)}
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("accum", [1, 4])
def test_the_step_loss_and_gradients_are_the_mean_over_the_valid_labels_of_the_step(runs, accum):
    records, loader, start, grads = runs[accum]
    first = loader.batches[:accum]
    inputs, labels = torch.cat([b[0] for b in first]), torch.cat([b[1] for b in first])
    count = int((labels != IGNORE_INDEX).sum())
    loss = F.cross_entropy(start(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum") / count
    loss.backward()
    assert records[0]["loss_tokens"] == count < labels.numel() // 2
    assert records[0]["loss"] == pytest.approx(loss.item(), rel=RTOL)
    for name, p in start.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_one_micro_batch_and_four_accumulated_ones_take_the_same_steps(runs):
    one, four = runs[1][0], runs[4][0]
    assert [r["loss_tokens"] for r in one] == [r["loss_tokens"] for r in four]
    assert [r["loss"] for r in four] == pytest.approx([r["loss"] for r in one], rel=RTOL)
    assert [r["grad_norm"] for r in four] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)


def test_the_masked_micro_batches_would_tell_a_mean_of_means_apart(runs):
    # Guards the comparison: the accumulated micro-batches' valid counts differ enough that averaging their means
    # is not the step's token mean, and some micro-batch of the run has no valid label at all (it adds 0, no NaN).
    records, loader, start, _ = runs[4]
    assert min(int((b[1] != IGNORE_INDEX).sum()) for b in loader.batches) == 0
    counts = [int((b[1] != IGNORE_INDEX).sum()) for b in loader.batches[:4]]
    with torch.no_grad():
        sums = [F.cross_entropy(start(b[0]).flatten(0, 1), b[1].flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum").item() for b in loader.batches[:4]]
    means = [s / c for s, c in zip(sums, counts) if c]  # (a mean over no label is NaN)
    mean_of_means = sum(means) / len(means)
    assert abs(mean_of_means - records[0]["loss"]) > 1e-3 * records[0]["loss"]
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN


def test_a_micro_batch_without_a_valid_label_adds_zero_loss_and_zero_gradients():
    from titan_npu.trainer.loss import chunked_linear_cross_entropy, cross_entropy_loss, token_weighted_loss

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    weight = torch.randn(32, 16, generator=g, requires_grad=True)
    labels = torch.full((2, 8), IGNORE_INDEX)
    # The chunked cross entropy (and so a DeepSeek-V3 multi-token prediction term on shifted labels): 0, not 0 / 0.
    chunked = chunked_linear_cross_entropy(hidden, weight, labels, 5)
    # A pipeline's loss function: the mean runs on a stand-in label, weighted 0.
    piped = token_weighted_loss(cross_entropy_loss, 4, lambda: 0)(hidden @ weight.t(), labels)
    for loss in (chunked, piped):
        assert loss.item() == 0.0
        hidden.grad = weight.grad = None
        loss.backward()
        assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0

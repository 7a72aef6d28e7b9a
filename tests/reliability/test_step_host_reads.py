"""The training step never reads a device value on the host outside log steps, with the numerics guard on (the
default): a non-finite step is skipped on a flag that stays on the device, and counted at the next log step."""

from __future__ import annotations

import traceback

import pytest
import torch
from fault_hooks import Faults
from torch.overrides import TorchFunctionMode

from titan_npu.config.loader import load_config
from titan_npu.parallel.degrees import Degrees
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.reduce import clip_grad_norm_
from titan_npu.trainer import Trainer

from .conftest import checkpoint_steps, records, tiny_args

# Tensor methods that copy a value to the host and make it wait for the device.
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
# Functions that read host tensors only (they refuse a device tensor): the loader's labels counted before they move.
HOST_ONLY = {"valid_labels"}


class HostReads(TorchFunctionMode):
    """Records (trainer step, method, where) of every host read made while it is active."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.reads: list[tuple[int, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            stack = traceback.extract_stack(limit=3)
            if stack[1].name in HOST_ONLY:
                return func(*args, **(kwargs or {}))
            where = stack[0]
            self.reads.append((self.trainer.step, name, f"{where.filename}:{where.lineno}"))
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


def _trainer(tmp_path, **extra) -> Trainer:
    args = tiny_args(tmp_path, training__max_steps=12, metrics__log_interval=5, checkpoint__enable=False, **extra)
    return Trainer(load_config(None, args))


def _train(trainer: Trainer, mode: TorchFunctionMode | None = None) -> None:
    try:
        if mode is None:
            trainer.train()
        else:
            with mode:
                trainer.train()
    finally:
        trainer.close()


def test_a_run_reads_device_values_on_the_host_only_at_log_steps(tmp_path, one_thread):
    trainer = _trainer(tmp_path)
    assert trainer.reliability.guard.active  # the default: skip_nonfinite
    reads = HostReads(trainer)
    _train(trainer, reads)
    outside = [r for r in reads.reads if r[0] not in (0, 1, 5, 10, 12)]  # 0: before the first step
    assert outside == []
    assert {step for step, _, _ in reads.reads} >= {1, 5, 10, 12}  # the log steps do read: the hook sees them


def test_a_moe_run_reads_device_values_on_the_host_only_at_log_steps(tmp_path, one_thread):
    # Routing, capacity drops, the aux loss and the expert load stay on the device until a log step reads them.
    trainer = _trainer(tmp_path, model__name="qwen3_moe", model__capacity_factor=1.0)
    assert trainer.routing.active
    reads = HostReads(trainer)
    _train(trainer, reads)
    assert [r for r in reads.reads if r[0] not in (0, 1, 5, 10, 12)] == []


@pytest.mark.slow  # a 12-step trainer run of its own; the document-masking runs above hold the loop to it by default
def test_a_hybrid_linear_attention_run_with_documents_reads_on_the_host_only_at_log_steps(tmp_path, one_thread):
    # Qwen3-Next: the chunked delta rule loops over chunks by shape, its document resets are device masks.
    trainer = _trainer(tmp_path, model__name="qwen3_next", model__n_layers=2, model__full_attention_interval=2,
                       data__document_mask=True)
    reads = HostReads(trainer)
    _train(trainer, reads)
    assert [r for r in reads.reads if r[0] not in (0, 1, 5, 10, 12)] == []


@pytest.mark.parametrize("reset", [False, True], ids=["document_mask", "reset_position_ids"])
def test_a_document_masking_run_reads_device_values_on_the_host_only_at_log_steps(tmp_path, one_thread, reset):
    # The documents' boundaries come with the batch from the loader (host ints and a tensor sent to the device).
    trainer = _trainer(tmp_path, data__document_mask=True, data__reset_position_ids=reset)
    reads = HostReads(trainer)
    _train(trainer, reads)
    assert [r for r in reads.reads if r[0] not in (0, 1, 5, 10, 12)] == []


@pytest.mark.parametrize("implementation", ["fused", "foreach"])  # on the device flag / read on the host
def test_a_nan_between_log_steps_is_skipped_exactly_and_counted_at_the_next_log_step(
        tmp_path, one_thread, caplog, implementation):
    trainer = _trainer(tmp_path, optimizer__implementation=implementation)
    assert trainer.reliability.deferred == (implementation == "fused")
    Faults(nan_at=7).install(trainer)
    states: dict[int, list[torch.Tensor]] = {}

    def keep(step: int) -> None:
        opt = trainer.optimizer
        tensors = [p.detach().clone() for p in trainer.model.parameters()]
        tensors += [t.clone() for s in opt.state.values() for t in s.values()]  # moments and step counts
        states[step] = tensors

    trainer.step_callbacks.append(keep)
    reads = HostReads(trainer)
    _train(trainer, reads)
    assert all(torch.equal(a, b) for a, b in zip(states[6], states[7], strict=True))  # nothing of step 7 applied
    assert not all(torch.equal(a, b) for a, b in zip(states[7], states[8], strict=True))
    assert all(torch.isfinite(t).all() for t in states[12])
    assert trainer.reliability.guard.total == 1 and trainer.reliability.guard.last_applied_step == 12
    assert "step 7: update skipped (non-finite loss on rank 0); 1 in a row" in caplog.text
    assert [(r["step"], r["skipped_steps"]) for r in records(tmp_path)] == [(1, 0), (5, 0), (10, 1), (12, 1)]
    if implementation == "fused":
        assert [r for r in reads.reads if r[0] not in (0, 1, 5, 10, 12)] == []


def test_the_run_halts_at_the_log_step_that_counts_the_limit_with_that_steps_checkpoint(tmp_path, one_thread,
                                                                                          capsys):
    from titan_npu.cli import run_command
    from titan_npu.train import main

    def nan_at_6_and_7(step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step in (6, 7) else loss

    args = tiny_args(tmp_path, training__max_steps=12, metrics__log_interval=5, checkpoint__save_interval=100,
                     checkpoint__async_save=False, reliability__max_skipped_steps=2)
    assert run_command(lambda a: main(a, setup=lambda t: t.loss_hooks.append(nan_at_6_and_7)), args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("TrainingHalted: steps 6-7: 2 updates in a row were skipped"), err
    assert f"the weights of step 10 (the last update applied) are saved in {tmp_path / 'ckpt' / 'step-10'}" in err
    assert checkpoint_steps(tmp_path) == [10]
    assert [(r["step"], r["skipped_steps"]) for r in records(tmp_path)] == [(1, 0), (5, 0), (10, 2)]


class HostCopies(TorchFunctionMode):
    """Records every copy of a host tensor to another device made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("to", "copy_", "cuda") and isinstance(out, torch.Tensor):
            source = args[1] if func.__name__ == "copy_" else args[0]
            if isinstance(source, torch.Tensor) and source.device.type == "cpu" and out.device.type != "cpu":
                self.copies.append(f"{func.__name__} to {out.device}")
        return out


def test_the_grad_norm_is_summed_on_the_gradients_device_with_no_copy_from_the_host():
    # The meta device stands in for an accelerator: any host tensor moved to it is a host-to-device copy.
    params = [torch.nn.Parameter(torch.empty(4, 8, device="meta")), torch.nn.Parameter(torch.empty(8, device="meta"))]
    for p in params:
        p.grad = torch.empty_like(p)
    copies = HostCopies()
    with copies:
        norm = clip_grad_norm_(params, 1.0, ParallelDims(Degrees()), foreach=False)
    assert norm.device.type == "meta" and copies.copies == []

"""With labels masked as supervised fine-tuning masks them (about 70% -100, sequences with two valid labels or none:
tests/masked_labels.py), every layout of 2 gloo ranks takes the step of one process on the whole global batch, whose
loss is sum(CE over the valid labels of the step) / their count: the per-step losses equal to 1e-5 relative, the
gradient norms to 1e-4 and the logged loss_tokens exactly, over 3 fp32 steps. Layouts: FSDP 2 and DP-replicate 2
with 2 accumulated micro-batches, TP 2 (loss_parallel) with 4, PP 2 under 1F1B and Interleaved1F1B (4
microbatches), CP 2 (ring, load-balanced chunks: some micro-batches leave a rank no valid label) with 4."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from .harness import losses, run_here, run_pool, tiny_run, write_tokens

pytestmark = pytest.mark.distributed

STEPS = 3
SMALL = ["--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2", "--training.seq_len=16",
         f"--training.max_steps={STEPS}"]
LAYOUTS = {  # name -> (overrides, batch_size); a step is 4 sequences in every layout
    "fsdp_accum2": (["--training.gradient_accumulation_steps=2"], 1),
    "replicate_accum2": (["--parallel.fsdp=false", "--training.gradient_accumulation_steps=2"], 1),
    "tp_accum4": (["--parallel.tp_degree=2", "--training.gradient_accumulation_steps=4"], 1),
    "pp_1f1b": (["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B", "--parallel.pp_microbatches=4"], 4),
    "pp_interleaved_1f1b": (["--parallel.pp_degree=2", "--parallel.pp_schedule=Interleaved1F1B",
                             "--parallel.pp_microbatches=4"], 4),
    "cp_ring_accum4": (["--parallel.cp_degree=2", "--parallel.cp_mode=ring",
                        "--training.gradient_accumulation_steps=4"], 1),
}
RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4


def _masked_train(args: list[str]) -> None:
    """A training run whose loader's labels are masked (the test's data hook), in this pool process."""
    from masked_labels import MaskedLoader

    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    trainer = Trainer(load_config(None, args))
    trainer.dataloader = MaskedLoader(trainer.dataloader)
    trainer.train()
    # Not trainer.close(): the process group stays up for the pool's next run.
    trainer.checkpointer.close()
    trainer.metrics.close()


@pytest.fixture(scope="module")
def masked_runs(tmp_path_factory) -> Path:
    """The single-process reference (4 sequences, one micro-batch) and every layout, each run once."""
    workdir = tmp_path_factory.mktemp("masked_layouts")
    write_tokens(workdir / "tokens.jsonl")
    run_here([partial(_masked_train, tiny_run(workdir, "reference", 4) + SMALL)])
    run_pool(2, [partial(_masked_train, tiny_run(workdir, name, batch_size) + SMALL + overrides)
                 for name, (overrides, batch_size) in LAYOUTS.items()])
    return workdir


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_layout_steps_equal_one_process_on_the_token_mean(masked_runs, name):
    tokens, want_tokens = losses(masked_runs, name, "loss_tokens"), losses(masked_runs, "reference", "loss_tokens")
    assert len(want_tokens) == STEPS and tokens == want_tokens
    assert all(t < 16 * 4 // 2 for t in want_tokens)  # most labels masked
    got, want = losses(masked_runs, name), losses(masked_runs, "reference")
    assert got == pytest.approx(want, rel=RTOL), f"{name}:\n{got}\n{want}"
    norms, want_norms = losses(masked_runs, name, "grad_norm"), losses(masked_runs, "reference", "grad_norm")
    assert norms == pytest.approx(want_norms, rel=GRAD_NORM_RTOL), f"{name} grad_norm:\n{norms}\n{want_norms}"

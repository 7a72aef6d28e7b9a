"""A run resumed from its step-k checkpoint continues with the losses of the uninterrupted run, bit for bit.

Deterministic fp32 on CPU: the data position, RNG states, optimizer moments and lr schedule all come from the
checkpoint, so nothing distinguishes the resumed steps from the uninterrupted ones.
"""

from __future__ import annotations

import json

import pytest
import torch

from titan_npu.checkpoint import storage
from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata

from .runs import PROBE, copy_checkpoint, losses, overrides, run_distributed, run_here

# The tiny run's model as Qwen3: q/k norms, a head size (32) set apart from dim / n_heads, the output tied to the
# embedding (one parameter saved under both names and restored into one).
QWEN3 = dict(model__name="qwen3", model__head_dim=32, model__ffn_dim=128, model__tie_embeddings=True)
# Muon: the momentum buffers of its matrices saved beside AdamW's moments of the embedding, output and norms.
MODELS = {"llama3": {}, "qwen3": QWEN3, "llama3_muon": dict(optimizer__name="Muon")}


@pytest.mark.parametrize("model", list(MODELS))
def test_single_process_resume_gives_bitwise_equal_losses(tmp_path, model):
    run_here(overrides(tmp_path, "full", training__max_steps=6, checkpoint__save_interval=3,
                       checkpoint__async_save=True, **MODELS[model]))
    copy_checkpoint(tmp_path, "full", 3, "resumed")
    trainer = run_here(overrides(tmp_path, "resumed", training__max_steps=6, checkpoint__save_interval=3,
                                 **MODELS[model]))

    full, resumed = losses(tmp_path, "full"), losses(tmp_path, "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]
    assert trainer.tokens_seen == 6 * 2 * 32
    assert [ref.step for ref in storage.list_checkpoints(tmp_path / "resumed" / "ckpt")] == [3, 6]


def test_a_finished_run_resumed_again_does_nothing(tmp_path):
    run_here(overrides(tmp_path, "run", training__max_steps=2, checkpoint__save_interval=5))
    info = json.loads((tmp_path / "run" / "ckpt" / "step-2" / storage.INFO_FILE).read_text())
    trainer = run_here(overrides(tmp_path, "run", training__max_steps=2, checkpoint__save_interval=5))
    assert trainer.step == 2
    assert json.loads((tmp_path / "run" / "ckpt" / "step-2" / storage.INFO_FILE).read_text()) == info


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """FSDP over 2 gloo ranks: 6 steps with checkpoints at 3 and 6 (async) and a run resumed from step 3; then the
    step-6 checkpoint continued for one step under TP 2 and under PP 2 (checked on load and against their own
    step-7 checkpoints), and its exported .pt as the initial_load of a new FSDP run. Then the tied Qwen3: 6 steps
    and a run resumed from step 3, under FSDP and under TP 2."""
    tmp = tmp_path_factory.mktemp("fsdp")
    step6 = tmp / "full" / "ckpt" / "step-6"
    one_more = dict(training__max_steps=7, checkpoint__resume=str(step6), checkpoint__async_save=True)
    run_distributed(2, [
        {"args": overrides(tmp, "full", training__max_steps=6, checkpoint__save_interval=3,
                           checkpoint__async_save=True), "then_probe": tmp / "probe.pt"},
        {"args": overrides(tmp, "resumed", training__max_steps=6, checkpoint__save_interval=3),
         "copy": (tmp, "full", 3, "resumed")},
        {"args": overrides(tmp, "tp2", parallel__tp_degree=2, **one_more), "probe": tmp / "probe_tp2.pt",
         "compare_to": (step6, tmp / "tp2"), "then_compare_to": (tmp / "tp2" / "ckpt" / "step-7", tmp / "tp2_7")},
        {"args": overrides(tmp, "pp2", parallel__pp_degree=2, parallel__pp_microbatches=2, **one_more),
         "compare_to": (step6, tmp / "pp2"), "then_compare_to": (tmp / "pp2" / "ckpt" / "step-7", tmp / "pp2_7")},
        {"args": overrides(tmp, "init", checkpoint__initial_load=str(tmp / "step6.pt")), "train": False,
         "export": (step6, tmp / "step6.pt"), "probe": tmp / "probe_init.pt"},
        *[job for layout, extra in QWEN3_LAYOUTS.items() for job in (
            {"args": overrides(tmp, f"{layout}_full", training__max_steps=6, checkpoint__save_interval=3,
                               **QWEN3, **extra)},
            {"args": overrides(tmp, f"{layout}_resumed", training__max_steps=6, checkpoint__save_interval=3,
                               **QWEN3, **extra),
             "copy": (tmp, f"{layout}_full", 3, f"{layout}_resumed")})],
    ])
    return tmp


# Run names and overrides of the tied Qwen3 runs of fsdp_runs.
QWEN3_LAYOUTS = {"qwen3_fsdp2": {}, "qwen3_tp2": dict(parallel__tp_degree=2)}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["llama3_fsdp2", *QWEN3_LAYOUTS])
def test_two_ranks_resume_gives_bitwise_equal_losses(fsdp_runs, layout):
    run = "" if layout == "llama3_fsdp2" else f"{layout}_"
    full, resumed = losses(fsdp_runs, f"{run}full"), losses(fsdp_runs, f"{run}resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]


@pytest.mark.distributed
def test_fsdp_checkpoint_loads_on_one_process_with_equal_logits_and_optimizer_state(fsdp_runs):
    step6 = fsdp_runs / "full" / "ckpt" / "step-6"
    # max_steps = the saved step: load, run no step, keep the state to inspect.
    from titan_npu import ops
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    ops.set_kernels("reference")
    trainer = Trainer(load_config(None, overrides(fsdp_runs, "single", training__max_steps=6,
                                                  checkpoint__resume=str(step6))))
    try:
        assert trainer.step == 6
        with torch.no_grad():
            ours = trainer.model(PROBE)
        reference = torch.load(fsdp_runs / "probe.pt", weights_only=True)
        assert (ours - reference).abs().max().item() < 1e-5

        metadata = read_metadata(step6)
        keys = [k for k in metadata.state_dict_metadata if k.startswith("optimizer.state.")]
        saved = load_tensors(step6, metadata, keys)
        params = dict(trainer.model.named_parameters())
        for key, value in saved.items():
            fqn, slot = key[len("optimizer.state."):].rsplit(".", 1)
            assert torch.equal(trainer.optimizer.state[params[fqn]][slot], value), key
    finally:
        trainer.close()


@pytest.mark.distributed
def test_fsdp_checkpoint_loads_under_tensor_parallel_with_equal_logits(fsdp_runs):
    reference = torch.load(fsdp_runs / "probe.pt", weights_only=True)
    tp = torch.load(fsdp_runs / "probe_tp2.pt", weights_only=True)
    assert (tp - reference).abs().max().item() < 1e-5
    for rank in (0, 1):
        report = json.loads((fsdp_runs / f"tp2.rank{rank}.json").read_text())
        assert report["checked"] > 0 and report["mismatched"] == []


@pytest.mark.distributed
def test_fsdp_checkpoint_loads_under_pipeline_parallel_with_every_stage_intact(fsdp_runs):
    reports = [json.loads((fsdp_runs / f"pp2.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["mismatched"] == [] for r in reports)
    # Two stages of a 2-layer model: every parameter (9 per layer + embedding, norm, output) and its AdamW state
    # (step, exp_avg, exp_avg_sq) is checked on exactly one rank.
    assert sum(r["checked"] for r in reports) == 4 * (2 * 9 + 3)


@pytest.mark.distributed
def test_an_exported_pt_starts_a_sharded_run_with_the_same_logits(fsdp_runs):
    reference = torch.load(fsdp_runs / "probe.pt", weights_only=True)
    started = torch.load(fsdp_runs / "probe_init.pt", weights_only=True)
    assert (started - reference).abs().max().item() < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_checkpoint_saved_under_tensor_or_pipeline_parallel_holds_the_full_state(fsdp_runs, layout):
    # Read back offline in one process, the step-7 checkpoint equals what each rank held when it was saved.
    reports = [json.loads((fsdp_runs / f"{layout}_7.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["checked"] > 0 and r["mismatched"] == [] for r in reports)
    assert storage.read_info(fsdp_runs / layout / "ckpt" / "step-7")["layout"].startswith("world=2")


@pytest.mark.distributed
def test_fsdp_two_rank_checkpoint_loads_on_four_ranks_intact(fsdp_runs):
    step6 = fsdp_runs / "full" / "ckpt" / "step-6"
    run_distributed(4, [{"args": overrides(fsdp_runs, "fsdp4", training__max_steps=6, checkpoint__resume=str(step6)),
                         "train": False, "probe": fsdp_runs / "probe_fsdp4.pt",
                         "compare_to": (step6, fsdp_runs / "fsdp4")}])
    reference = torch.load(fsdp_runs / "probe.pt", weights_only=True)
    assert (torch.load(fsdp_runs / "probe_fsdp4.pt", weights_only=True) - reference).abs().max().item() < 1e-5
    reports = [json.loads((fsdp_runs / f"fsdp4.rank{rank}.json").read_text()) for rank in range(4)]
    assert all(r["checked"] > 0 and r["mismatched"] == [] for r in reports)

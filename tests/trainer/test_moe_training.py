"""configs/debug_moe.toml trains: a falling cross entropy, the load-balancing loss optimised beside it and logged
with the expert load (and dropped tokens under a capacity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_moe.toml"


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


def _run(tmp_path: Path, steps: int, *extra: str) -> list[dict]:
    """debug_moe shrunk to 4 sequences of 64 tokens, every step logged; its training records."""
    overrides = ["--training.seq_len", "64", "--training.batch_size", "4", "--training.max_steps", str(steps),
                 "--lr_scheduler.warmup_steps", "2", "--metrics.log_dir", str(tmp_path / "logs"),
                 "--metrics.log_interval", "1", "--metrics.tensorboard", "false", "--metrics.report", "false",
                 "--metrics.progress", "lines", "--checkpoint.dir", str(tmp_path / "ckpt"),
                 "--checkpoint.enable", "false", *extra]
    trainer = Trainer(load_config(CONFIG, overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_debug_moe_trains_with_a_falling_loss_and_logs_the_aux_loss_and_expert_load(tmp_path, one_thread):
    records = _run(tmp_path, 8)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for r in records:
        # An even load gives top_k = 2 (transformers' normalisation); any load gives at least that much.
        assert 2.0 <= r["aux_loss"] < 8.0
        assert len(r["expert_load_per_layer"]) == 4 and r["expert_load_max_mean"] >= 1.0
        assert "dropped_tokens" not in r  # dropless


def test_the_logged_loss_is_the_cross_entropy_and_the_aux_term_moves_the_weights(tmp_path, one_thread):
    off = _run(tmp_path / "off", 2, "--model.router_aux_loss_coef", "0")
    on = _run(tmp_path / "on", 2, "--model.router_aux_loss_coef", "1.0")
    assert on[0]["loss"] == off[0]["loss"]  # the same weights and batch: the logged loss excludes the aux term
    assert on[0]["aux_loss"] == off[0]["aux_loss"]  # logged even where it is not optimised
    assert on[1]["loss"] != off[1]["loss"]  # the first update differed: the aux term was in the optimised loss


def test_a_capacity_factor_logs_the_dropped_tokens(tmp_path, one_thread):
    records = _run(tmp_path, 2, "--model.capacity_factor", "0.5")
    # Capacity 0.5 x 256 tokens x 2 / 8 experts = 32 per expert per layer: at most half the 512 assignments fit.
    assert all(r["dropped_tokens"] >= 4 * 256 for r in records)


def _torchrun(tmp_path: Path, *extra: str, nproc: int = 2) -> list[float]:
    """debug_moe shrunk as _run does, on `nproc` CPU processes (gloo); the logged losses."""
    import os
    import subprocess
    import sys

    root = CONFIG.parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(TITAN_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py",
           "--config", str(CONFIG), "--training.seq_len", "64", "--training.max_steps", "3",
           "--lr_scheduler.warmup_steps", "2", "--metrics.log_dir", str(tmp_path / "logs"),
           "--metrics.log_interval", "1", "--metrics.tensorboard", "false", "--metrics.report", "false",
           "--metrics.progress", "lines", "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.enable", "false",
           "--training.deterministic", "true", *extra]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


# The aux loss is pooled over each rank's micro-batch (as transformers pools one forward's tokens), so a layout
# that splits the batch optimises a slightly different sum: the layouts agree exactly with it off. Expert
# parallelism moves tokens between ranks but routes each on the rank that holds it: the same per-rank pooling.
# ep 2 on 4 ranks: each pair of ranks holds half the experts, sharded by FSDP over the 2 pairs.
@pytest.mark.parametrize("nproc, layout", [(2, ["--parallel.dp_shard", "2", "--training.batch_size", "2"]),
                                           (2, ["--parallel.pp_degree", "2", "--training.batch_size", "4"]),
                                           (2, ["--parallel.ep_degree", "2", "--training.batch_size", "2"]),
                                           (4, ["--parallel.ep_degree", "2", "--training.batch_size", "1"])],
                         ids=["fsdp", "pp", "ep", "ep-x-fsdp"])
def test_fsdp_pipeline_and_expert_parallel_runs_give_the_single_process_losses(tmp_path, one_thread, nproc,
                                                                                  layout):
    single = [r["loss"] for r in _run(tmp_path / "one", 3, "--model.router_aux_loss_coef", "0",
                                      "--training.deterministic", "true")]
    split = _torchrun(tmp_path / "split", "--model.router_aux_loss_coef", "0", *layout, nproc=nproc)
    assert split == pytest.approx(single, rel=1e-5)


def test_a_checkpoint_saved_under_expert_parallelism_resumes_in_one_process_exactly(tmp_path, one_thread):
    import shutil

    # The experts are saved under their global names and shapes (DTensors sharded on the expert dim), so one
    # process loads them whole: resumed at step 3 of a 2-rank ep 2 run, it goes on as an uninterrupted run does.
    common = ["--model.router_aux_loss_coef", "0", "--training.deterministic", "true", "--training.max_steps", "6",
              "--checkpoint.enable", "true", "--checkpoint.save_interval", "3", "--checkpoint.keep_last_n", "5",
              "--checkpoint.dir", str(tmp_path / "ckpt")]
    _torchrun(tmp_path / "ep", *common, "--parallel.ep_degree", "2", "--training.batch_size", "2")
    shutil.rmtree(tmp_path / "ckpt" / "step-6")  # resume from step 3
    resumed = _run(tmp_path / "resumed", 6, *common)
    whole = _run(tmp_path / "whole", 6, "--model.router_aux_loss_coef", "0", "--training.deterministic", "true")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[3:]], rel=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.tp_degree", "2"], "tensor parallelism of a MoE model"),
    (["--parallel.pp_degree", "2"], "the load-balancing loss spans every stage's layers"),
], ids=["tp", "pp-with-aux-loss"])
def test_layouts_a_moe_model_does_not_take_yet_are_refused_in_one_line(overrides, message):
    import torch

    from titan_npu.errors import LayoutError
    from titan_npu.models.registry import build_model_args, get_spec
    from titan_npu.parallel import ParallelDims

    cfg = load_config(CONFIG, ["--parallel.dp_shard", "1", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, 2)
    spec, args = get_spec("qwen3_moe"), build_model_args(cfg.model)
    with torch.device("meta"):
        model = spec.build_model(args)
    with pytest.raises(LayoutError, match=message) as error:
        spec.parallelize(model, dims, cfg)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["--parallel.ep_degree", "3"], "parallel.ep_degree=3 must divide dp_shard=2"),
    (3, ["--parallel.ep_degree", "3"], "does not divide model.n_experts=8"),
    (4, ["--parallel.ep_degree", "2", "--parallel.tp_degree", "2"], "with tensor parallelism (tp_degree=2)"),
    (4, ["--parallel.ep_degree", "2", "--parallel.pp_degree", "2"], "with pipeline parallelism (pp_degree=2)"),
    (2, ["--parallel.ep_degree", "2", "--model.capacity_factor", "1.0"], "expert parallelism is dropless only"),
    (2, ["--parallel.ep_degree", "2", "--model.name", "qwen3"], "has no MoE layer"),
], ids=["ep-not-dividing-dp-shard", "ep-not-dividing-experts", "ep-x-tp", "ep-x-pp",
        "ep-with-capacity", "ep-on-a-dense-model"])
def test_expert_parallel_layouts_this_version_does_not_take_are_refused_in_one_line(world, overrides, message):
    from titan_npu.errors import LayoutError
    from titan_npu.models.registry import build_model_args
    from titan_npu.parallel import ParallelDims
    from titan_npu.parallel.layout import validate_layout

    cfg = load_config(CONFIG, overrides)
    with pytest.raises(LayoutError) as error:
        validate_layout(ParallelDims.from_config(cfg.parallel, world), build_model_args(cfg.model), cfg)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_expert_parallel_dry_run_measures_each_ranks_experts_and_runs_forward_with_balanced_routing():
    from titan_npu.planner.dry_run import dry_run

    # The exchange's split sizes are routed token counts, which fake tensors do not hold: the dry run exchanges
    # with balanced routing's sizes instead.
    result = dry_run(load_config(CONFIG, ["--parallel.ep_degree", "2"]), 4, 1)
    assert result.forward_checked
    w1 = result.parameters["layers.0.feed_forward.experts.w1"]
    assert w1["shape"] == [8, 128, 128] and w1["local_shape"] == [2, 128, 128]  # 8 experts over ep 2 x FSDP 2


def test_with_the_aux_loss_on_expert_parallel_gives_the_fsdp_runs_losses(tmp_path, one_thread):
    # Tokens are routed, and the aux loss pooled, on the rank that holds them under either layout: only where the
    # experts run differs, so the optimised sums are the same (fp32, deterministic).
    fsdp = _torchrun(tmp_path / "fsdp", "--training.batch_size", "2")
    ep = _torchrun(tmp_path / "ep", "--training.batch_size", "2", "--parallel.ep_degree", "2")
    assert ep == pytest.approx(fsdp, rel=1e-5)

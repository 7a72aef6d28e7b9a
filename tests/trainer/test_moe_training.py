"""configs/debug_moe.toml trains: a falling cross entropy, the load-balancing loss optimised beside it and logged
with the expert load (and dropped tokens under a capacity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_moe.toml"


def _as_one_cpu_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    _as_one_cpu_process(monkeypatch)


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


def _layout_run(workdir: Path, name: str, *extra: str) -> list[str]:
    """The overrides of layout run `name`: debug_moe shrunk as _run does, 3 deterministic steps logged to
    workdir/name/logs (checkpoints in workdir/name/ckpt unless `extra` says otherwise)."""
    return ["--training.seq_len", "64", "--training.max_steps", "3", "--lr_scheduler.warmup_steps", "2",
            "--metrics.log_dir", str(workdir / name / "logs"), "--metrics.log_interval", "1",
            "--metrics.tensorboard", "false", "--metrics.report", "false", "--metrics.progress", "lines",
            "--checkpoint.dir", str(workdir / name / "ckpt"), "--checkpoint.enable", "false",
            "--training.deterministic", "true", *extra]


def _records(log_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (log_dir / "logs" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


NO_AUX = ["--model.router_aux_loss_coef", "0"]
AUX_ON = ["--model.router_aux_loss_coef", "1.0", "--training.deterministic", "true"]
ONE_SEQUENCE_A_FORWARD = ["--training.batch_size", "1", "--training.gradient_accumulation_steps", "4"]

# The aux loss is pooled over each rank's micro-batch (as transformers pools one forward's tokens), so a layout
# that splits the batch optimises a slightly different sum: the layouts agree exactly with it off. Expert
# parallelism moves tokens between ranks but routes each on the rank that holds it: the same per-rank pooling.
# ep 2 x HSDP 2 x 2: each replica's 2 ranks split the experts, the 2 replicas of an expert shard it with FSDP (ep 2
# x FSDP 2 on 4 ranks, the experts sharded over the ep groups, is the resume test's last layout).
# id -> (ranks, layout).
AUX_OFF_LAYOUTS = {
    "fsdp": (2, ["--parallel.dp_shard", "2", "--training.batch_size", "2"]),
    "ep": (2, ["--parallel.ep_degree", "2", "--training.batch_size", "2"]),
    "ep-x-hsdp": (4, ["--parallel.ep_degree", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                      "--training.batch_size", "1"]),
}

# Each forward pools the aux loss over its own tokens: one sequence per micro-batch everywhere (one process: 4
# accumulation steps of 1; the pipelines: micro-batches of 1), so every layout optimises the same sum. Expert
# parallelism routes each token, and pools the aux loss, on the rank that holds it (as FSDP does). The pipeline's
# last stage pools every stage's MoE layers (the stages carry their routing sums on), and the routing metrics are
# gathered from every stage. ep 2 x pp 2: each pipeline stage's 2 data-parallel ranks split its experts. Under tp 2
# the ranks route the whole (gathered) sequence, each running half of every expert's ffn dim; ep 2 x tp 2: each rank
# holds half of the ffn dim of half of the experts and exchanges tokens with the ranks of its tp coordinate (FSDP
# shards the dense part over dp x tp); fsdp 2 x tp 2: FSDP shards the experts' tp shards too.
# ep alone and pp alone run with -m slow: ep 2 x pp 2 and ep 2 x tp 2 cover both in the default suite.
AUX_ON_LAYOUTS = {
    "ep": (2, ["--parallel.ep_degree", "2", "--training.batch_size", "1", "--training.gradient_accumulation_steps",
               "2"]),
    "pp": (2, ["--parallel.pp_degree", "2", "--training.batch_size", "4"]),
    "ep-x-pp": (4, ["--parallel.pp_degree", "2", "--parallel.ep_degree", "2", "--parallel.pp_microbatches", "2",
                    "--training.batch_size", "2"]),
    "ep-x-tp": (4, ["--parallel.tp_degree", "2", "--parallel.ep_degree", "2", "--training.batch_size", "1",
                    "--training.gradient_accumulation_steps", "2"]),
    "fsdp-x-tp": (4, ["--parallel.tp_degree", "2", "--training.batch_size", "1",
                      "--training.gradient_accumulation_steps", "2"]),
}
AUX_ON_SLOW = ("ep", "pp", "fsdp-x-tp")

# The experts are saved under their global names and shapes (DTensors sharded on the expert dim), so any layout
# loads them: step 3 of a one-process run resumed at ep 2 on 2 ranks, and step 3 of a 2-rank ep 2 run resumed in one
# process and at ep 2 x FSDP 2 on 4 ranks, go on as the uninterrupted run does (the same global batch).
EP = ["--parallel.ep_degree", "2"]


def _saving(ckpt: Path) -> list[str]:
    """6 steps without the aux loss, saved at steps 3 and 6 in `ckpt` (resumed from the latest there)."""
    return [*NO_AUX, "--training.deterministic", "true", "--training.max_steps", "6", "--checkpoint.enable", "true",
            "--checkpoint.save_interval", "3", "--checkpoint.keep_last_n", "5", "--checkpoint.dir", str(ckpt)]


@pytest.fixture(scope="module")
def layout_runs(request, tmp_path_factory) -> Path:
    """Every selected layout of the tests below and the resume runs: one process's runs in this one, the others in
    a 2-rank and a 4-rank pool of processes (a launch each instead of one per run), each run after the
    checkpoints it resumes."""
    import shutil

    import torch
    from parallel.harness import config_run, run_pools, selected_ids

    work = tmp_path_factory.mktemp("moe_layouts")
    pools: dict[int, list] = {2: [], 4: []}
    for name in selected_ids(request, "test_fsdp_pipeline_and_expert_parallel_runs_give_the_single_process_losses"):
        ranks, layout = AUX_OFF_LAYOUTS[name]
        pools[ranks].append(config_run(CONFIG, _layout_run(work, f"aux_off_{name}", *NO_AUX, *layout)))
    for name in selected_ids(request, "test_with_the_aux_loss_on_pp_tp_and_ep_layouts_give_the_single_process_losses"
                                   "_and_routing"):
        ranks, layout = AUX_ON_LAYOUTS[name]
        pools[ranks].append(config_run(CONFIG, _layout_run(work, f"aux_on_{name}", *AUX_ON, *layout)))
    resume = bool(selected_ids(request, "test_a_run_resumes_under_another_expert_parallel_degree_with_the_uninterrupted"
                                     "_losses"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _as_one_cpu_process(monkeypatch)
            _run(work / "aux_off_one", 3, *NO_AUX, "--training.deterministic", "true")
            _run(work / "aux_on_one", 3, *AUX_ON, *ONE_SEQUENCE_A_FORWARD)
            if resume:
                _run(work / "whole", 6, *_saving(work / "one_ckpt"))
                shutil.rmtree(work / "one_ckpt" / "step-6")  # resumed from step 3
                pools[2] += [config_run(CONFIG, _layout_run(work, "ep", *_saving(work / "ep_ckpt"), *EP,
                                                            "--training.batch_size", "2")),
                             config_run(CONFIG, _layout_run(work, "to_ep", *_saving(work / "one_ckpt"), *EP,
                                                            "--training.batch_size", "2"))]
            run_pools({2: pools.pop(2)})
            if resume:
                shutil.rmtree(work / "ep_ckpt" / "step-6")
                shutil.copytree(work / "ep_ckpt", work / "ep_ckpt_copy")
                pools[4].append(config_run(CONFIG, _layout_run(work, "to_ep_fsdp", *_saving(work / "ep_ckpt_copy"),
                                                               *EP, "--training.batch_size", "1")))
                _run(work / "to_one", 6, *_saving(work / "ep_ckpt"))
            run_pools(pools)
    finally:
        torch.set_num_threads(threads)
    return work


@pytest.mark.parametrize("name", list(AUX_OFF_LAYOUTS))
def test_fsdp_pipeline_and_expert_parallel_runs_give_the_single_process_losses(layout_runs, name):
    single = [r["loss"] for r in _records(layout_runs / "aux_off_one")]
    split = [r["loss"] for r in _records(layout_runs / f"aux_off_{name}")]
    assert len(split) == 3 and split == pytest.approx(single, rel=1e-5)


def test_the_aux_loss_parity_reference_optimises_the_aux_loss(tmp_path, one_thread, layout_runs):
    # Without the aux term the second step's loss differs: the layouts below agree on a sum that includes it.
    off = _run(tmp_path, 2, *NO_AUX, "--training.deterministic", "true", *ONE_SEQUENCE_A_FORWARD)
    assert off[1]["loss"] != pytest.approx(_records(layout_runs / "aux_on_one")[1]["loss"], rel=1e-4)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in AUX_ON_SLOW else name
                                  for name in AUX_ON_LAYOUTS])
def test_with_the_aux_loss_on_pp_tp_and_ep_layouts_give_the_single_process_losses_and_routing(layout_runs, name):
    single, records = _records(layout_runs / "aux_on_one"), _records(layout_runs / f"aux_on_{name}")
    assert len(records) == 3
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    assert [r["aux_loss"] for r in records] == pytest.approx([r["aux_loss"] for r in single], rel=1e-5)
    assert [r["expert_load_per_layer"] for r in records] == [r["expert_load_per_layer"] for r in single]


def test_a_run_resumes_under_another_expert_parallel_degree_with_the_uninterrupted_losses(layout_runs):
    whole = [r["loss"] for r in _records(layout_runs / "whole")]
    resumed = {"ep 2 -> one process": "to_one", "one process -> ep 2": "to_ep", "ep 2 -> ep 2 x FSDP 2": "to_ep_fsdp"}
    for how, name in resumed.items():
        records = _records(layout_runs / name)
        assert [r["step"] for r in records] == [4, 5, 6], how
        assert [r["loss"] for r in records] == pytest.approx(whole[3:], rel=1e-5), how


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["--parallel.ep_degree", "3"], "parallel.ep_degree=3 must divide dp_shard=2"),
    (3, ["--parallel.ep_degree", "3"], "does not divide model.n_experts=8"),
    (8, ["--parallel.ep_degree", "2", "--parallel.tp_degree", "2"], "and ep_degree < dp_shard=4"),
    (8, ["--parallel.ep_degree", "2", "--parallel.dp_replicate", "2"], "dp_replicate=2 and ep_degree < dp_shard=4"),
    (2, ["--parallel.ep_degree", "2", "--model.mlp_only_layers", "[0, 1, 2, 3]"], "has no MoE layer"),
    (2, ["--parallel.tp_degree", "2", "--parallel.dp_shard", "1", "--model.moe_ffn_dim", "127"],
     "does not divide model.moe_ffn_dim=127"),
    (2, ["--parallel.tp_degree", "2", "--parallel.dp_shard", "1", "--model.shared_ffn_dim", "63"],
     "does not divide model.shared_ffn_dim=63"),
], ids=["ep-not-dividing-dp-shard", "ep-not-dividing-experts", "ep-x-tp", "ep-x-hsdp-below-dp-shard",
        "ep-on-a-dense-model", "tp-not-dividing-the-expert-ffn", "tp-not-dividing-the-shared-ffn"])
def test_moe_layouts_this_version_does_not_take_are_refused_in_one_line(world, overrides, message):
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

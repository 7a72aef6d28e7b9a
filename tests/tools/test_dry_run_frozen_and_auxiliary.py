"""The dry run of a model with an auxiliary loss and frozen parameters (DeepSeek-V3.2's lightning indexers: trained by
their KL loss alone; the dense warm-up freezes all but them): its backward is the trainer's loss, cross entropy plus
auxiliary_loss(), and the planner's bytes, which leave out what does not learn, equal the dry run's in both stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_npu.commands import plan as plan_cli
from titan_npu.config.loader import load_config
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.layout import job_from_config, layout_from_config
from titan_npu.planner.parameters import checkpoint_bytes, frozen_kinds, state_bytes
from titan_npu.planner.verify import compare_with_plan

DEBUG = Path(__file__).resolve().parents[2] / "configs" / "debug_deepseek_v32.toml"
TINY = ["--training.seq_len", "32", "--training.batch_size", "2", "--model.n_layers", "2"]
WARMUP = ["--model.dsa_stage", "dense_warmup"]

# name: (world size, rank, overrides on the tiny debug run, which parameters learn)
LAYOUTS = {
    "sparse stage, FSDP 2: the indexers learn by their KL loss": (2, 1, [], "all"),
    "dense warm-up, FSDP 2: the indexers alone learn": (2, 0, WARMUP, "indexers"),
    "dense warm-up, FSDP 4 x ep 2": (4, 3, [*WARMUP, "--parallel.ep_degree", "2"], "indexers"),
    "sparse stage with frozen indexers, pp 2 x FSDP 2, the output's stage": (
        4, 3, ["--model.indexer_loss_weight", "0", "--parallel.pp_degree", "2", "--training.batch_size", "4"],
        "all but indexers"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_equals_the_dry_run_and_only_learning_parameters_get_gradients(name):
    world, rank, overrides, learning = LAYOUTS[name]
    cfg = load_config(DEBUG, [*TINY, *overrides])
    result = dry_run(cfg, world, rank)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked and comparison["match"], comparison["problems"]
    with_grad = {n for n, p in result.parameters.items() if "grad_local_shape" in p}
    indexers = {n for n in result.parameters if ".indexer." in n}
    want = {"all": set(result.parameters), "indexers": indexers,
            "all but indexers": set(result.parameters) - indexers}[learning]
    assert indexers and with_grad == want
    job = job_from_config(cfg)
    planned = state_bytes(job, layout_from_config(cfg, world), rank)
    if learning != "all":
        assert 0 < planned.gradients < planned.parameters and planned.optimizer == 2 * planned.gradients


def test_the_warm_up_freezes_every_kind_but_the_indexers_and_checkpoints_their_state_alone():
    cfg = load_config(DEBUG, [*TINY, *WARMUP])
    job = job_from_config(cfg)
    args = job.args
    assert frozen_kinds(args) and not any(".indexer." in kind for kind in frozen_kinds(args))
    assert {"tok_embeddings.weight", "output.weight", "attention.wq_a.weight"} <= frozen_kinds(args)
    # fp32 weights of the whole model, AdamW's two moments of the indexers' only.
    assert checkpoint_bytes(job) == 4 * args.num_params() + 2 * 4 * args.n_layers * args.indexer_params()
    sparse = job_from_config(load_config(DEBUG, TINY))
    assert not frozen_kinds(sparse.args) and checkpoint_bytes(sparse) == 3 * 4 * sparse.args.num_params()


def test_plan_verify_of_the_debug_config_agrees_in_both_stages(capsys):
    for stage in ("sparse", "dense_warmup"):
        code = plan_cli.main(["--config", str(DEBUG), "--nodes", "1", "--devices-per-node", "2", "--verify",
                              "--rank", "1", "--json", "--model.dsa_stage", stage])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["verify"]["comparison"]["match"], report["verify"]["comparison"]["problems"]

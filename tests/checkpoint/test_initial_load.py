"""checkpoint.initial_load: start from weights in any supported format; refuse what does not fit, saying why."""

from __future__ import annotations

import pytest
import torch

from titan_npu.checkpoint.fit import describe_mismatch
from titan_npu.checkpoint.initial_load import load_initial_weights
from titan_npu.errors import CheckpointError
from titan_npu.models.llama import Transformer, to_hf

from .conftest import TINY, job_config, model_manager, random_model, tokens_for, train_steps

ARGS = TINY["llama2-mha"]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_a_step_checkpoint_gives_its_weights_and_optionally_its_optimizer_state(tmp_path):
    source = random_model(ARGS, seed=0)
    manager, opt, sched, state = model_manager(job_config(tmp_path / "pretrain"), source, ARGS)
    train_steps(source, opt, sched, state, tokens_for(ARGS, seq_len=9), 2)
    manager.save(2)
    step2 = tmp_path / "pretrain" / "ckpt" / "step-2"

    weights_only = random_model(ARGS, seed=1)
    m1, opt1, _, state1 = model_manager(job_config(tmp_path / "a", initial_load=str(step2)), weights_only, ARGS)
    assert m1.load() is False and state1.step == 0  # a new run: step and schedule start over
    assert _same(weights_only, source) and not opt1.state

    with_optimizer = random_model(ARGS, seed=1)
    m2, opt2, sched2, state2 = model_manager(
        job_config(tmp_path / "b", initial_load=str(step2), initial_load_model_only=False), with_optimizer, ARGS)
    m2.load()
    assert _same(with_optimizer, source) and state2.step == 0 and sched2.last_epoch == 0
    params = dict(with_optimizer.named_parameters())
    for name, p in source.named_parameters():
        assert torch.equal(opt2.state[params[name]]["exp_avg"], opt.state[p]["exp_avg"]), name


def test_a_full_pt_loads_and_weights_without_optimizer_state_refuse_model_only_false(tmp_path):
    source = random_model(ARGS, seed=2)
    torch.save(source.state_dict(), tmp_path / "full.pt")
    target = Transformer(ARGS)
    load_initial_weights(target, tmp_path / "full.pt", ARGS)
    assert _same(target, source)
    with pytest.raises(CheckpointError, match=r"is pt weights, which hold no optimizer state; set "
                                              r"checkpoint.initial_load_model_only=true"):
        load_initial_weights(Transformer(ARGS), tmp_path / "full.pt", ARGS, model_only=False)


def test_hugging_face_names_in_a_pt_are_named_as_the_cause(tmp_path):
    torch.save(to_hf(random_model(ARGS, seed=3).state_dict(), ARGS), tmp_path / "hf_names.pt")
    with pytest.raises(CheckpointError) as err:
        load_initial_weights(Transformer(ARGS), tmp_path / "hf_names.pt", ARGS)
    message = str(err.value)
    assert "21 missing key(s) (e.g. tok_embeddings.weight" in message
    assert "21 unexpected key(s) (e.g. model.embed_tokens.weight" in message
    assert "Hugging Face names" in message and "titan-npu import" in message


def test_one_file_of_a_sharded_checkpoint_is_refused_with_the_directory_to_use(tmp_path):
    manager, *_ = model_manager(job_config(tmp_path), random_model(ARGS, seed=4), ARGS)
    manager.save(1)
    shard = next((tmp_path / "ckpt" / "step-1").glob("*.distcp"))
    with pytest.raises(CheckpointError, match=r"is one file of a sharded \(DCP\) checkpoint; pass its directory"):
        load_initial_weights(Transformer(ARGS), shard, ARGS)


def test_a_step_checkpoint_without_its_manager_is_refused_naming_the_way_to_load_it(tmp_path):
    manager, *_ = model_manager(job_config(tmp_path), random_model(ARGS, seed=4), ARGS)
    manager.save(1)
    step1 = tmp_path / "ckpt" / "step-1"
    with pytest.raises(CheckpointError) as err:
        load_initial_weights(Transformer(ARGS), step1, ARGS)
    assert str(err.value) == f"{step1} is a step-N checkpoint; load it through CheckpointManager"

def test_pickled_objects_in_a_pt_are_refused(tmp_path):
    torch.save({"tok_embeddings.weight": torch.zeros(2), "extra": torch.nn.Linear(2, 2)}, tmp_path / "code.pt")
    with pytest.raises(CheckpointError, match=r"not a tensor file torch.load\(weights_only=True\) accepts"):
        load_initial_weights(Transformer(ARGS), tmp_path / "code.pt", ARGS)


def test_a_directory_without_weights_lists_what_is_expected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"holds no weights this tool reads: expected config.json"):
        load_initial_weights(Transformer(ARGS), tmp_path / "empty", ARGS)


@pytest.mark.parametrize("found, cause", [
    ({"_orig_mod.tok_embeddings.weight": (4, 2)}, "wrapped model"),
    ({"layers.0.w": (1,), "layers.1.w": (1,)}, "checkpoint has 2 layers, the model 1"),
    ({"x": (1,)}, "no key matches"),
])
def test_mismatch_causes(found, cause):
    problem = describe_mismatch({"tok_embeddings.weight": (4, 2), "layers.0.w": (1,)}, found)
    assert cause in problem


# A model of one layer with multi-token-prediction layers (layers.1 on, model.mtp_depth): a difference there alone
# names mtp_depth, never n_layers; one in a main layer does not.
@pytest.mark.parametrize("depth, found, cause", [
    (1, {"layers.0.w": (1,)}, "holds 0 whole multi-token-prediction layer(s) (layers.1 on), the model 1 "
                              "(model.mtp_depth): set model.mtp_depth=0"),
    (2, {"layers.0.w": (1,), "layers.1.w": (1,), "layers.1.e": (1,), "layers.2.w": (1,)},
     "holds 1 whole multi-token-prediction layer(s) (layers.1 on), the model 2 (model.mtp_depth): set "
     "model.mtp_depth=1"),
    (0, {"layers.0.w": (1,), "layers.1.w": (1,), "layers.1.e": (1,)},
     "holds 1 multi-token-prediction layer(s) (layers.1 on), the model 0 (model.mtp_depth): set model.mtp_depth=1"),
    (1, {"layers.1.w": (1,), "layers.1.e": (1,)}, "the checkpoint was written for another model layout"),
], ids=["absent", "partial-second", "extra", "main-layer-missing"])
def test_mismatch_of_multi_token_prediction_layers_names_mtp_depth(depth, found, cause):
    class Args:  # the family's ModelSpec.extra_blocks reads mtp_depth
        n_layers, mtp_depth, family = 1, depth, "deepseek_v3"

    expected = {"layers.0.w": (1,), **{f"layers.{1 + k}.{name}": (1,) for k in range(depth) for name in "we"}}
    problem = describe_mismatch(expected, found, Args())
    assert cause in problem and "n_layers" not in problem


def test_a_fitting_state_dict_has_no_mismatch():
    assert describe_mismatch({"a": (2, 3)}, {"a": torch.zeros(2, 3)}) is None

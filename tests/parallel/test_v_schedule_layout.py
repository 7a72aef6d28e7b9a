"""The V schedules' stage placement and the layouts they refuse: each refusal one line naming the value and the fix,
before any model is built (the command line prints a LayoutError as one line and exits 2: test_layout.py)."""

from __future__ import annotations

import pytest

from titan_npu.errors import LayoutError
from titan_npu.models.decoder.pipeline import split_layers
from titan_npu.models.registry import build_model_args
from titan_npu.parallel import validate_layout
from titan_npu.parallel.arithmetic import leftover_stages, reshards_after_forward, stage_ids_for_rank
from titan_npu.parallel.layout import pp_stages_per_rank

from .test_layout import check, job

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v_placement_gives_rank_r_stages_r_and_its_mirror(pp):
    placed = [stage_ids_for_rank(r, pp, 2, "ZBVZeroBubble") for r in range(pp)]
    assert placed == [[r, 2 * pp - 1 - r] for r in range(pp)]
    assert sorted(s for ids in placed for s in ids) == list(range(2 * pp))  # every stage once
    assert placed[0] == [0, 2 * pp - 1]  # the embedding and the output on the same rank
    # torch's own V mapping, which the schedule checks the stages against
    from torch.distributed.pipelining.schedules import generate_rank_to_stage_mapping

    assert placed == [list(generate_rank_to_stage_mapping(pp, 2 * pp, style="v")[r]) for r in range(pp)]


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_runs_two_stages_per_rank(schedule):
    dims, cfg = job(2, pp_degree=2, pp_schedule=schedule)
    assert pp_stages_per_rank(cfg) == 2
    validate_layout(dims, build_model_args(cfg.model), cfg)
    check(2, pp_degree=2, pp_schedule=schedule, pp_virtual_stages=2)


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_refuses_other_virtual_stages(schedule):
    with pytest.raises(LayoutError, match=rf"pp_schedule={schedule} runs exactly 2 stages per rank .* "
                                          r"pp_virtual_stages=3; set pp_virtual_stages = 0"):
        check(2, pp_degree=2, pp_schedule=schedule, pp_virtual_stages=3, model=_llama(12))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_takes_unequal_stages_and_refuses_fewer_layers_than_stages(schedule):
    # 6 layers at pp 2: 4 stages of unequal size run; 3 layers cannot fill 4 stages, and no V fits them at all.
    check(2, pp_degree=2, pp_schedule=schedule, model=_llama(6))
    check(2, pp_degree=2, pp_schedule=schedule, model=_llama(5))
    with pytest.raises(LayoutError, match=rf"n_layers=5 is fewer than the 6 stages of {schedule} at pp_degree=3 "
                                          r"\(2 per rank, placed in a V; every stage needs a layer\); set "
                                          r"parallel.pp_degree to at most 2, or use 1F1B"):
        check(3, pp_degree=3, pp_schedule=schedule, model=_llama(5), batch_size=6)
    with pytest.raises(LayoutError, match=r"n_layers=3 is fewer than the 4 stages .*needs a layer\); use 1F1B"):
        check(2, pp_degree=2, pp_schedule=schedule, model=_llama(3))


@pytest.mark.parametrize("n_layers,pp", [(61, 4), (61, 8), (94, 8), (5, 2), (6, 2), (7, 3), (8, 2), (15, 4)])
def test_v_split_gives_leftover_layers_to_the_ranks_other_than_rank_0_first(n_layers, pp):
    # Rank 0 holds the first and the last stage (the embedding, the output projection and the loss): the layers an
    # even split leaves over go one per rank to ranks 1 .. pp - 1 (first arm, then second), rank 0 only the last.
    stages = split_layers(n_layers, 2 * pp, leftover_stages(2 * pp, "ZBVZeroBubble"))
    assert [i for s in stages for i in s] == list(range(n_layers)) and all(stages)
    per_rank = [sum(len(stages[i]) for i in stage_ids_for_rank(r, pp, 2, "ZBVZeroBubble")) for r in range(pp)]
    extra = [count - n_layers // (2 * pp) * 2 for count in per_rank]
    assert extra[0] == (1 if n_layers % (2 * pp) == 2 * pp - 1 else 0)
    assert max(extra[1:]) - min(extra[1:]) <= 1 and min(extra[1:]) >= extra[0]
    # the other schedules keep their split: the middle stages first, then the first, then the last
    assert split_layers(n_layers, 2 * pp, leftover_stages(2 * pp, "1F1B")) == split_layers(n_layers, 2 * pp)


def test_v_schedules_refuse_fewer_microbatches_than_they_need():
    with pytest.raises(LayoutError, match=r"pp_microbatches=3 is fewer than the 4 microbatches DualPipeV needs at "
                                          r"pp_degree=2 \(one per stage of the V\); set parallel.pp_microbatches >= 4"):
        check(2, pp_degree=2, pp_schedule="DualPipeV", pp_microbatches=3, batch_size=6)
    with pytest.raises(LayoutError, match=r"pp_microbatches=2 is fewer than the 3 microbatches ZBVZeroBubble needs "
                                          r"at pp_degree=2 \(2 x pp_degree - 1, to fill the V\); set "
                                          r"parallel.pp_microbatches >= 3"):
        check(2, pp_degree=2, pp_schedule="ZBVZeroBubble", pp_microbatches=2)
    check(2, pp_degree=2, pp_schedule="ZBVZeroBubble", pp_microbatches=3, batch_size=6)


def test_v_schedule_refuses_fp16_and_compile():
    dims, cfg = job(2, pp_degree=2, pp_schedule="DualPipeV")
    cfg.training.dtype = "fp16"
    with pytest.raises(LayoutError, match="fp16 .* use bf16"):
        validate_layout(dims, build_model_args(cfg.model), cfg)
    dims, cfg = job(2, pp_degree=2, pp_schedule="ZBVZeroBubble")
    cfg.compile.enable = True
    with pytest.raises(LayoutError, match="compile.enable=true is not available with parallel.pp_schedule="
                                          "ZBVZeroBubble: torch's split input/weight backward"):
        validate_layout(dims, build_model_args(cfg.model), cfg)


def test_split_backward_schedules_keep_fsdp_parameters_gathered_until_the_weight_step():
    for schedule in (*V_SCHEDULES, "InterleavedZeroBubble"):
        assert not reshards_after_forward(True, 2, schedule)
    assert reshards_after_forward(True, 2, "1F1B") and reshards_after_forward(True, 1, "DualPipeV")
    assert not reshards_after_forward(False, 2, "1F1B")


def _llama(n_layers: int):
    from titan_npu.config.schema import ModelConfig

    return ModelConfig(name="llama3", flavor="debug", dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                       vocab_size=512, max_seq_len=64)

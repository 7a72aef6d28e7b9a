"""How the planner models the split-backward pipeline schedules (ZBVZeroBubble, DualPipeV, InterleavedZeroBubble):
their bubble and peak in-flight forwards equal what torch's own action order gives when replayed, the dry run of a
config using each holds exactly the planned bytes and shards, and `plan` ranks ZBVZeroBubble with the others."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from titan_npu.config.loader import load_config
from titan_npu.models.llama import LlamaArgs
from titan_npu.parallel.arithmetic import stage_ids_for_rank
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import in_flight_forwards, rank_activations, v_in_flight_forwards
from titan_npu.planner.dry_run import dry_run
from titan_npu.planner.hardware import hardware
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.perf import estimate_step, pipeline_bubble
from titan_npu.planner.search import candidate_layouts, config_overrides, is_valid, layout_from_config, make_plan
from titan_npu.planner.stages import rank_parts
from titan_npu.planner.verify import compare_with_plan

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ROOT / "configs" / "debug.toml"
TINY = ["--training.seq_len", "64", "--training.batch_size", "4", "--training.dtype", "bf16"]
F, BI, W, B = torch_schedules.F, torch_schedules.I, torch_schedules.W, torch_schedules.B
# A chunk's forward, input backward and weight backward equally long; a full backward is both halves.
SECONDS = {F: 1.0, BI: 1.0, W: 1.0, B: 2.0}


def torch_order(schedule: str, pp: int, m: int, v: int = 2) -> dict[int, list]:
    """Each rank's compute actions in torch's order (the schedule class's own planning, without building stages);
    DualPipeV's overlapped pairs run one after the other, as torch runs them without a custom overlap function."""
    cls = torch_schedules.get_schedule_class(schedule)
    rounds = max(1, m // pp)
    fake = SimpleNamespace(pp_group_size=pp, num_stages=v * pp, _num_stages=v * pp, _n_microbatches=m,
                           n_local_stages=v, number_of_rounds=rounds, microbatches_per_round=m // rounds)
    orders = {r: [a for a in cls._calculate_single_rank_operations(fake, r) if a is not None] for r in range(pp)}
    return {r: [sub for a in acts for sub in (a.sub_actions or (a,))] for r, acts in orders.items()}


def replay(orders: dict[int, list], n_stages: int) -> tuple[float, float]:
    """(step time, largest idle fraction of a rank): each rank runs its actions in order, each as soon as the rank
    is free and what it needs is done (a forward: the previous stage's; a backward: the next stage's)."""
    done, clock, busy = {}, dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0.0)
    position = dict.fromkeys(orders, 0)
    moved = True
    while moved:
        moved = False
        for r, acts in orders.items():
            while position[r] < len(acts):
                a = acts[position[r]]
                s, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
                if kind == F:
                    needs = [(s - 1, mb, F)] if s > 0 else []
                elif kind in (BI, B):
                    needs = [(s + 1, mb, BI)] if s < n_stages - 1 else [(s, mb, F)]
                else:
                    needs = [(s, mb, BI)]
                if any(n not in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = start + SECONDS[kind]
                busy[r] += SECONDS[kind]
                done[s, mb, F if kind == F else BI if kind in (BI, B) else W] = clock[r]
                position[r] += 1
                moved = True
    assert all(position[r] == len(acts) for r, acts in orders.items()), "the order deadlocks"
    step = max(clock.values())
    return step, max(1 - busy[r] / step for r in orders)


def peak_in_flight(actions: list) -> int:
    """Most forwards whose activations a rank holds at once: from a forward to its weight (or full) backward."""
    held = peak = 0
    for a in actions:
        held += 1 if a.computation_type == F else -1 if a.computation_type in (W, B) else 0
        peak = max(peak, held)
    return peak


def held_at_peak(actions: list) -> dict[int, int]:
    """Forwards held per stage at the first moment the rank's total peaks."""
    held, best, total = {}, {}, 0
    for a in actions:
        kind = a.computation_type
        held[a.stage_index] = held.get(a.stage_index, 0) + (1 if kind == F else -1 if kind in (W, B) else 0)
        if sum(held.values()) > total:
            total, best = sum(held.values()), dict(held)
    return best


def layout(schedule: str, pp: int, m: int, v: int = 0) -> Layout:
    return Layout(Degrees(pp=pp), batch_size=m, pp_microbatches=m, pp_schedule=schedule, pp_virtual_stages=v)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"])
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (8, 16)])
def test_bubble_and_in_flight_forwards_are_torchs_order_replayed(schedule, pp, m):
    orders = torch_order(schedule, pp, m)
    _, idle = replay(orders, 2 * pp)
    assert pipeline_bubble(layout(schedule, pp, m)) == pytest.approx(idle, abs=1e-12)
    for r, actions in orders.items():
        assert in_flight_forwards(layout(schedule, pp, m), r) == peak_in_flight(actions), f"rank {r}"
        if schedule != "InterleavedZeroBubble":  # the V: each stage's share of the peak
            stages = stage_ids_for_rank(r, pp, 2, schedule)
            held = held_at_peak(actions)
            assert v_in_flight_forwards(layout(schedule, pp, m), r) == tuple(held[s] for s in stages), f"rank {r}"


@pytest.mark.parametrize("pp,m", [(2, 3), (3, 5), (4, 7)])
def test_zbv_at_its_fewest_microbatches(pp, m):
    orders = torch_order("ZBVZeroBubble", pp, m)
    assert pipeline_bubble(layout("ZBVZeroBubble", pp, m)) == pytest.approx(replay(orders, 2 * pp)[1], abs=1e-12)
    assert [in_flight_forwards(layout("ZBVZeroBubble", pp, m), r) for r in orders] == [
        peak_in_flight(actions) for actions in orders.values()]
    for r, actions in orders.items():
        held = held_at_peak(actions)
        assert v_in_flight_forwards(layout("ZBVZeroBubble", pp, m), r) == tuple(
            held[s] for s in stage_ids_for_rank(r, pp, 2, "ZBVZeroBubble"))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_interleaved_zero_bubble_with_three_stages_per_rank(pp, m):
    _, idle = replay(torch_order("InterleavedZeroBubble", pp, m, v=3), 3 * pp)
    assert pipeline_bubble(layout("InterleavedZeroBubble", pp, m, v=3)) == pytest.approx(idle, abs=1e-12)


def test_v_schedules_idle_less_than_1f1b_and_interleaved_at_the_same_microbatches():
    for pp, m in [(2, 4), (4, 8), (8, 16)]:
        zbv, one = pipeline_bubble(layout("ZBVZeroBubble", pp, m)), pipeline_bubble(layout("1F1B", pp, m))
        assert zbv < pipeline_bubble(layout("Interleaved1F1B", pp, m)) < one
        assert zbv == pytest.approx((pp - 1) / (6 * m + pp - 1))


def test_v_placement_holds_every_rank_to_1f1b_first_rank_activations():
    # 8 equal layers at pp 4: a V stage holds 1 layer, a 1F1B stage 2. The middle ranks (blocks only): ZBV keeps 8
    # one-layer forwards on each, 1F1B 3 and 2 two-layer ones, DualPipeV one one-layer forward more than ZBV.
    args = LlamaArgs(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64)
    job = Job(args, seq_len=64, dtype="bf16")
    saved = {}
    for schedule in ("1F1B", "ZBVZeroBubble", "DualPipeV"):
        lay = layout(schedule, 4, 8)
        saved[schedule] = [rank_activations(job, lay, r).saved for r in (1, 2)]
        assert [len(p.layers) for p in rank_parts(args, lay, 1)] == ([2] if schedule == "1F1B" else [1, 1])
    layer = saved["ZBVZeroBubble"][0] // 8
    assert saved["ZBVZeroBubble"] == [8 * layer, 8 * layer]
    assert saved["DualPipeV"] == [9 * layer, 9 * layer]
    assert saved["1F1B"] == [3 * 2 * layer, 2 * 2 * layer]


@pytest.mark.parametrize("schedule,world,rank", [
    ("ZBVZeroBubble", 2, 0), ("ZBVZeroBubble", 2, 1), ("DualPipeV", 4, 1), ("DualPipeV", 4, 2),
])
def test_dry_run_of_a_v_schedule_holds_the_planned_stages_and_bytes(schedule, world, rank):
    cfg = load_config(DEBUG, [*TINY, "--parallel.pp_degree", "2", "--parallel.pp_schedule", schedule])
    result = dry_run(cfg, world, rank)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked
    assert comparison["match"], comparison["problems"]
    pp_rank = result.coordinates["pp"]
    layers = {name.split(".")[1] for name in result.parameters if name.startswith("layers.")}
    assert layers == {str(pp_rank), str(3 - pp_rank)}  # 4 one-layer stages: rank r holds r and 3 - r
    assert ("tok_embeddings.weight" in result.parameters) == ("output.weight" in result.parameters) == (pp_rank == 0)


def test_plan_ranks_zbv_layouts_and_their_overrides_select_them():
    cfg = load_config(ROOT / "configs" / "llama_70b.toml", [])
    plan = make_plan(cfg, 8, 8, hardware("910B2"), top=1000)
    v_layouts = [c for c in plan.ranked if c.layout.pp_schedule == "ZBVZeroBubble"]
    assert v_layouts, "no ZBVZeroBubble layout ranked"
    for c in v_layouts[:5]:
        assert "--parallel.pp_schedule ZBVZeroBubble" in config_overrides(c.layout)
        assert is_valid(cfg, plan.job, c.layout)
        twin = replace(c.layout, pp_schedule="1F1B")
        assert pipeline_bubble(c.layout) < pipeline_bubble(twin)


def test_plan_of_a_v_config_takes_unequal_stages_and_falls_back_to_1f1b_where_a_stage_would_be_empty():
    # 5 layers on 6 cards: pp 2 runs the V on 4 unequal stages; pp 3 would need 6 stages, so it plans 1F1B.
    cfg = load_config(DEBUG, [*TINY, "--model.n_layers", "5", "--parallel.pp_schedule", "DualPipeV"])
    plan = make_plan(cfg, 1, 6, hardware("910B2"), top=100000)
    tried = {(c.pp, c.pp_schedule, c.pp_microbatches >= 4)
             for c in candidate_layouts(cfg, plan.job, layout_from_config(cfg, 6), 6, 6, 24) if c.pp > 1}
    assert {(2, "DualPipeV", True), (2, "ZBVZeroBubble", True), (3, "1F1B", True)} <= tried
    # 1F1B at pp 2 only where the micro-batches are too few for the V (DualPipeV needs 4 there)
    assert not {(2, "1F1B", True), (3, "DualPipeV", True), (3, "ZBVZeroBubble", True)} & tried
    ranked = {(c.layout.pp, c.layout.pp_schedule) for c in plan.ranked if c.layout.pp > 1}
    assert (2, "ZBVZeroBubble") in ranked and (3, "1F1B") in ranked


@pytest.mark.parametrize("schedule,world,rank,n_layers", [
    ("ZBVZeroBubble", 2, 0, 5), ("ZBVZeroBubble", 2, 1, 5), ("DualPipeV", 4, 1, 6),
])
def test_dry_run_of_a_v_schedule_on_unequal_stages_holds_the_planned_stages_and_bytes(schedule, world, rank,
                                                                                     n_layers):
    # 5 or 6 layers in 4 stages: the leftovers go to rank 1's stages (1 and 2), rank 0 keeps one layer per stage
    # beside the embedding and the output; plan and dry run agree on every rank's layers and bytes.
    cfg = load_config(DEBUG, [*TINY, "--model.n_layers", str(n_layers), "--parallel.pp_degree", "2",
                              "--parallel.pp_schedule", schedule])
    result = dry_run(cfg, world, rank)
    comparison = compare_with_plan(result, cfg)
    assert result.forward_checked
    assert comparison["match"], comparison["problems"]
    pp_rank = result.coordinates["pp"]
    layers = {int(name.split(".")[1]) for name in result.parameters if name.startswith("layers.")}
    expected = {0: {0, n_layers - 1}, 1: set(range(1, n_layers - 1))}[pp_rank]
    assert layers == expected
    assert ("tok_embeddings.weight" in result.parameters) == ("output.weight" in result.parameters) == (pp_rank == 0)


def test_the_busiest_rank_of_unequal_v_stages_sets_the_compute_time():
    # 6 layers at pp 2: the V gives rank 1 four (stages 1 and 2) and rank 0 two beside the embedding and output, 1F1B
    # three each; the step computes at the busiest rank's pace, 4 / 3 of 1F1B's. 8 layers split evenly under both.
    hw = hardware("910B2")
    compute = {}
    for n_layers in (6, 8):
        args = LlamaArgs(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128,
                         max_seq_len=64)
        job = Job(args, seq_len=64, dtype="bf16")
        for schedule in ("1F1B", "ZBVZeroBubble"):
            compute[n_layers, schedule] = estimate_step(job, layout(schedule, 2, 4), hw, 8, efficiency=0.5).compute
    assert compute[6, "ZBVZeroBubble"] == pytest.approx(compute[6, "1F1B"] * 4 / 3, rel=1e-12)
    assert compute[8, "ZBVZeroBubble"] == pytest.approx(compute[8, "1F1B"], rel=1e-12)

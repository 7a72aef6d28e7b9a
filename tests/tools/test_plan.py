"""The planner: exact shard arithmetic, the memory and speed model's behaviour, and `titan-npu plan` end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from titan_npu.commands import plan as plan_cli
from titan_npu.config.loader import load_config
from titan_npu.config.schema import ActivationCheckpointConfig, JobConfig
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.models.llama import LlamaArgs
from titan_npu.models.registry import build_model_args
from titan_npu.parallel.arithmetic import chunk_size
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner import search
from titan_npu.planner.activations import block_bytes, checkpoint_kind, in_flight_forwards
from titan_npu.planner.hardware import hardware, parse_bytes
from titan_npu.planner.layout import (
    GiB,
    Job,
    Layout,
    job_from_config,
    layout_from_config,
)
from titan_npu.planner.memory import estimate_memory
from titan_npu.planner.parameters import local_numel, local_parameter_numels, parameter_kinds, state_bytes
from titan_npu.planner.perf import estimate_step, group_crosses_nodes, pipeline_bubble
from titan_npu.planner.stages import rank_parts
from titan_npu.planner.temporaries import temporary_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# A small model with awkward sizes: uneven FSDP chunks, GQA, more layers than pipeline stages.
ARGS = LlamaArgs(dim=96, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=250, ffn_dim=200, max_seq_len=64)
JOB = Job(ARGS, seq_len=64, dtype="bf16")


def _replica_ranks(layout: Layout) -> list[int]:
    """Every rank of the first data-parallel replica: together they hold one copy of the model."""
    return [r for r in range(layout.world_size) if layout.rank_coordinates(r)["dp_replicate"] == 0]


# --- exact shard arithmetic -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,parts", [(10, 3), (250, 4), (7, 8), (512, 2), (1, 1)])
def test_chunk_size_is_torch_chunk(n, parts):
    chunks = torch.arange(n).chunk(parts)
    assert [chunk_size(n, parts, i) for i in range(parts)] == [len(c) for c in chunks] + [0] * (parts - len(chunks))


@pytest.mark.parametrize("degrees", [(1, 4, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2), (3, 1, 1, 2)])
def test_rank_coordinates_invert_and_follow_the_mesh_order(degrees):
    rep, shard, tp, pp = degrees
    layout = Layout(Degrees(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp), batch_size=8)
    mesh = torch.arange(layout.world_size).reshape(pp, rep, shard, tp)  # init_device_mesh's row-major layout
    for rank in range(layout.world_size):
        c = layout.rank_coordinates(rank)
        assert mesh[c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"]] == rank
        assert layout.coordinates_rank(c) == rank


@pytest.mark.parametrize("layout", [
    Layout(Degrees(dp_shard=3)),
    Layout(Degrees(dp_shard=4, tp=2)),
    Layout(Degrees(dp_replicate=2, dp_shard=2, tp=2)),
    Layout(Degrees(dp_shard=2, pp=3), batch_size=6),
    Layout(Degrees(dp_shard=2, tp=2, pp=2), batch_size=4, pp_schedule="Interleaved1F1B"),
    Layout(Degrees(dp_shard=5, fsdp=False)),
], ids=lambda lay: lay.describe())
def test_one_replica_holds_exactly_the_model(layout):
    total = sum(local_numel(ARGS, layout, r) for r in _replica_ranks(layout))
    copies = 1 if layout.fsdp_enabled else layout.dp_shard  # without FSDP every rank holds a full copy
    norms = (2 * ARGS.n_layers + 1) * ARGS.dim  # replicated over tensor-parallel ranks
    assert total == copies * (ARGS.num_params() + (layout.tp - 1) * norms)


def test_local_numel_is_the_sum_over_named_shards():
    layout = Layout(Degrees(dp_shard=3, tp=2, pp=2), batch_size=4)
    for rank in range(layout.world_size):
        assert local_numel(ARGS, layout, rank) == sum(local_parameter_numels(ARGS, layout, rank).values())


def test_uneven_fsdp_chunks_give_later_ranks_less():
    layout = Layout(Degrees(dp_shard=4))
    first, last = local_parameter_numels(ARGS, layout, 0), local_parameter_numels(ARGS, layout, 3)
    # vocab 250 over 4 ranks: torch.chunk gives 63, 63, 63, 61 rows.
    assert first["tok_embeddings.weight"] == 63 * 96 and last["tok_embeddings.weight"] == 61 * 96


def test_state_bytes_count_fp32_parameters_gradients_and_optimizer_moments():
    layout = Layout(Degrees(dp_shard=2))
    numel = local_numel(ARGS, layout, 0)
    assert state_bytes(JOB, layout, 0).parameters == 4 * numel
    assert state_bytes(JOB, layout, 0).optimizer == 8 * numel  # AdamW: exp_avg + exp_avg_sq
    assert state_bytes(replace(JOB, optimizer="sgd"), layout, 0).optimizer == 4 * numel
    assert state_bytes(replace(JOB, optimizer="sgd", momentum=0.0), layout, 0).optimizer == 0


# --- agreement with the parallel code's own rules ---------------------------------------------------------------


@pytest.mark.parametrize("mode,every,ops", [("none", 2, False), ("full", 2, False), ("selective", 2, False),
                                            ("selective", 3, False), ("selective", 2, True)])
def test_checkpointed_blocks_are_the_ones_activation_checkpointing_wraps(mode, every, ops):
    from titan_npu.parallel.activation_checkpoint import blocks_to_checkpoint

    cfg = ActivationCheckpointConfig(mode=mode, selective_every=every, selective_ops=ops)
    wrapped = {int(i) for i in blocks_to_checkpoint([str(i) for i in range(12)], cfg)}
    layout = Layout(ac=mode, selective_every=every, selective_ops=ops)
    assert {i for i in range(12) if checkpoint_kind(i, layout) != "none"} == wrapped


@pytest.mark.parametrize("pp,schedule", [(2, "1F1B"), (3, "GPipe"), (2, "Interleaved1F1B"), (4, "Interleaved1F1B")])
def test_pipeline_parts_are_the_stages_the_trainer_cuts(pp, schedule):
    from titan_npu.models.decoder.pipeline import split_layers
    from titan_npu.parallel.arithmetic import stage_ids_for_rank
    from titan_npu.parallel.layout import pp_stages_per_rank

    cfg = JobConfig()
    cfg.parallel.pp_schedule = schedule
    per_rank = pp_stages_per_rank(cfg)
    args = replace(ARGS, n_layers=11)
    layers = split_layers(11, pp * per_rank)
    layout = Layout(Degrees(pp=pp), pp_schedule=schedule, batch_size=2 * pp)
    for pp_rank in range(pp):
        parts = rank_parts(args, layout, pp_rank)
        ids = stage_ids_for_rank(pp_rank, pp, per_rank)
        assert [p.stage for p in parts] == ids
        assert [list(p.layers) for p in parts] == [layers[i] for i in ids]
        assert [p.first for p in parts] == [i == 0 for i in ids]
        assert [p.last for p in parts] == [i == pp * per_rank - 1 for i in ids]


def test_layout_from_config_resolves_dp_shard_like_parallel_dims():
    cfg = JobConfig()
    cfg.parallel.tp_degree, cfg.parallel.dp_replicate = 2, 2
    layout = layout_from_config(cfg, 16)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp) == (2, 4, 2, 1)


# --- activations and temporaries ----------------------------------------------------------------------------------


def test_checkpointing_trades_activations_for_recomputation():
    acts = {ac: estimate_memory(JOB, Layout(Degrees(dp_shard=2), ac=ac, batch_size=4)).activations
            for ac in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]


def test_activations_grow_linearly_with_the_micro_batch():
    b = [block_bytes(JOB, Layout(Degrees(dp_shard=2)), mb).full for mb in (1, 2, 4)]
    assert b[1] == 2 * b[0] and b[2] == 4 * b[0]


def test_eager_attention_pays_for_the_sequence_squared():
    flash = block_bytes(JOB, Layout(), 1).full
    eager = block_bytes(replace(JOB, args=replace(ARGS, use_flash_attention=False)), Layout(), 1).full
    assert eager - flash > 1 * ARGS.n_heads * 64 * 64 * 4  # at least the fp32 probabilities


def test_one_f_one_b_holds_fewer_micro_batches_on_later_stages():
    layout = Layout(Degrees(pp=4), batch_size=8)
    assert [in_flight_forwards(layout, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_forwards(replace(layout, pp_schedule="GPipe"), 3) == 8


def test_fsdp_under_pipelining_keeps_whole_stages_unsharded():
    deep = replace(JOB, args=replace(ARGS, n_layers=12))
    plain = [temporary_bytes(job, Layout(Degrees(dp_shard=2), batch_size=4), 0, 0).fsdp for job in (JOB, deep)]
    piped = [temporary_bytes(job, Layout(Degrees(dp_shard=2, pp=2), batch_size=4), 0, 0).fsdp for job in (JOB, deep)]
    assert plain[1] == plain[0]  # FSDP alone gathers a block or two at a time, however deep the model
    assert piped[1] > 1.9 * piped[0]  # under pipelining every block of the stage stays gathered


def test_cpu_offload_moves_the_state_to_the_host():
    on_device = estimate_memory(JOB, Layout(Degrees(dp_shard=4)))
    offloaded = estimate_memory(JOB, Layout(Degrees(dp_shard=4), cpu_offload=True))
    assert offloaded.parameters == offloaded.gradients == offloaded.optimizer == 0
    state = on_device.parameters + on_device.gradients + on_device.optimizer
    assert offloaded.host_offload == state


def test_hccl_buffers_count_two_per_communicator():
    m = estimate_memory(JOB, Layout(Degrees(dp_shard=2, tp=2)), device_type="npu", hccl_buffsize_mb=100)
    assert m.communication == 3 * 2 * 100 * 2**20  # dp_shard, tp and the world group


def test_layout_refuses_micro_batches_that_do_not_divide_the_batch():
    with pytest.raises(LayoutError, match="micro-batches"):
        Layout(Degrees(pp=2), batch_size=3, pp_microbatches=2)


# --- speed model ---------------------------------------------------------------------------------------------------


def test_pipeline_bubble_is_the_textbook_fraction():
    assert pipeline_bubble(Layout(Degrees(pp=4), batch_size=12, pp_microbatches=12)) == pytest.approx(3 / 15)
    interleaved = Layout(Degrees(pp=4), batch_size=8, pp_schedule="Interleaved1F1B")
    assert pipeline_bubble(interleaved) == pytest.approx(1.5 / 9.5)
    assert pipeline_bubble(Layout()) == 0


def test_groups_that_span_nodes_use_the_slower_link():
    layout = Layout(Degrees(dp_shard=4, tp=4))
    assert not group_crosses_nodes(layout, "tp", 8) and group_crosses_nodes(layout, "dp_shard", 8)


def test_more_devices_at_the_same_global_batch_train_faster():
    hw = hardware("910B2")
    small = estimate_step(JOB, Layout(Degrees(dp_shard=2), batch_size=1, grad_accum=8), hw, devices_per_node=8)
    large = estimate_step(JOB, Layout(Degrees(dp_shard=8), batch_size=1, grad_accum=2), hw, devices_per_node=8)
    assert small.tokens_per_step == large.tokens_per_step
    assert large.tokens_per_s > small.tokens_per_s


def test_a_layouts_estimate_does_not_depend_on_the_layouts_its_job_sized_before():
    # Job.memo keeps tables per job under what they follow from: a layout sized after many others that share parts
    # of it (degrees, stages, checkpointing) gets what it gets on a fresh job. 7 layers: the 1F1B and interleaved
    # splits give pp rank 0 different blocks.
    args, hw = replace(ARGS, n_layers=7), hardware("910B2")
    degrees = [Degrees(dp_shard=4), Degrees(dp_shard=2, tp=2), Degrees(dp_replicate=2, dp_shard=2),
               Degrees(dp_shard=2, pp=2), Degrees(tp=2, pp=2), Degrees(dp_shard=2, cp=2),
               Degrees(dp_shard=4, fsdp=False)]
    checkpointing = [("none", False, 2), ("selective", False, 2), ("selective", False, 3), ("selective", True, 2),
                     ("full", False, 2)]
    layouts = [Layout(d, ac=ac, selective_ops=ops, selective_every=every, batch_size=batch, pp_schedule=schedule,
                      pp_virtual_stages=virtual, cpu_offload=offload)
               for d in degrees for ac, ops, every in checkpointing for batch in (4, 8)
               for schedule, virtual in ([("1F1B", 0), ("Interleaved1F1B", 3)] if d.pp > 1 else [("1F1B", 0)])
               for offload in ((False, True) if d.fsdp_enabled else (False,))]
    shared = Job(args, seq_len=64, dtype="bf16")
    for layout in layouts:
        fresh = Job(args, seq_len=64, dtype="bf16")
        assert estimate_memory(shared, layout, "npu") == estimate_memory(fresh, layout, "npu"), layout.describe()
        assert estimate_step(shared, layout, hw, 4, 0.4) == estimate_step(fresh, layout, hw, 4, 0.4), layout.describe()


@pytest.mark.parametrize("text,expected", [("64GB", 64 * GiB), ("80GiB", 80 * GiB), ("32768MB", 32 * GiB),
                                           ("1.5G", int(1.5 * GiB))])
def test_device_memory_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


def test_unknown_device_and_bad_sizes_are_refused():
    with pytest.raises(ConfigError, match="unknown"):
        hardware("TPUv9")
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes("lots")


# --- the command --------------------------------------------------------------------------------------------------


GUIDE_CASES = [("llama_7b.toml", 1, 4), ("llama_7b.toml", 1, 8), ("llama_13b.toml", 2, 8), ("llama_70b.toml", 8, 8),
               ("qwen3_32b.toml", 2, 8)]


@pytest.mark.parametrize("config,nodes,per_node", GUIDE_CASES, ids=["7B-4", "7B-8", "13B-16", "70B-64", "Qwen3-32B-16"])
def test_guides_cases_fit_and_rank_layouts_at_the_same_global_batch(config, nodes, per_node, capsys):
    code = plan_cli.main(["--config", str(CONFIGS / config), "--nodes", str(nodes), "--devices-per-node",
                          str(per_node), "--device", "910B2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["config_layout"]["fits"]
    ranked = report["ranked"]
    assert ranked and all(c["fits"] for c in ranked)
    # Ties (speeds equal to 6 decimals, e.g. ring and hybrid layouts summing the same terms in another order) go
    # to the roomier layout.
    speeds = [round(c["estimate"]["tokens_per_s"], 6) for c in ranked]
    assert speeds == sorted(speeds, reverse=True)
    global_tokens = report["training"]["global_batch_tokens"]
    assert all(c["estimate"]["tokens_per_step"] == global_tokens for c in ranked)
    for c in ranked:
        assert c["memory_bytes"]["total"] <= c["usable_gib"] * GiB + 1


def test_every_ranked_layout_passes_the_trainers_layout_checks():
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.layout import validate_layout

    cfg = load_config(CONFIGS / "llama_70b.toml", [])
    plan = search.make_plan(cfg, 8, 8, hardware("910B2"), top=30)
    for c in plan.ranked:
        candidate = search.config_for_layout(cfg, c.layout)
        validate_layout(ParallelDims.from_config(candidate.parallel, 64), plan.job.args, candidate)


def test_the_suggested_overrides_select_the_ranked_layout():
    cfg = load_config(CONFIGS / "llama_13b.toml", [])
    plan = search.make_plan(cfg, 2, 8, hardware("910B2"))
    best = plan.ranked[0].layout
    chosen = load_config(CONFIGS / "llama_13b.toml", search.config_overrides(best).split())
    assert layout_from_config(chosen, 16) == best


def test_a_layout_that_does_not_fit_exits_non_zero_and_says_so(capsys):
    code = plan_cli.main(["--config", str(CONFIGS / "llama_70b.toml"), "--nodes", "1", "--devices-per-node", "8",
                          "--parallel.tp_degree", "1", "--activation_checkpoint.mode", "none"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out


def test_a_layout_that_does_not_divide_the_world_is_named(capsys):
    code = plan_cli.main(["--config", str(CONFIGS / "llama_7b.toml"), "--nodes", "1", "--devices-per-node", "6",
                          "--parallel.tp_degree", "4"])
    out = capsys.readouterr().out
    assert code == 1 and "config layout does not apply to 6 ranks" in out and "tp_degree" in out


def test_memory_total_matches_its_lines():
    cfg = load_config(CONFIGS / "llama_7b.toml", [])
    m = estimate_memory(job_from_config(cfg), layout_from_config(cfg, 4), "npu")
    assert m.total == (m.parameters + m.gradients + m.optimizer + m.activations + m.temporary + m.communication
                       + m.runtime)


def test_parameter_kinds_cover_the_model():
    args = build_model_args(JobConfig().model)
    kinds = parameter_kinds(args)
    per_block = sum(int(torch.tensor(s).prod()) for k, s in kinds.items() if "." in k and not k.startswith(
        ("tok_", "norm.", "output.")))
    root = sum(int(torch.tensor(kinds[k]).prod()) for k in ("tok_embeddings.weight", "norm.weight", "output.weight"))
    assert args.n_layers * per_block + root == args.num_params()


def test_a_memory_fraction_cap_shrinks_what_a_plan_may_use():
    capped = load_config(CONFIGS / "llama_7b.toml", ["--training.memory_fraction", "0.5"])
    plan = search.make_plan(capped, 1, 4, hardware("910B2"))
    assert plan.config_candidate.usable_bytes == 32 * GiB
    assert all(c.memory.total <= 32 * GiB for c in plan.ranked)


def test_replicated_data_parallelism_pays_for_its_gradient_all_reduce():
    cfg = load_config(CONFIGS / "llama_7b.toml", [])
    job = job_from_config(cfg)
    layout = Layout(Degrees(dp_shard=16, fsdp=False), batch_size=1, grad_accum=1)
    across = estimate_step(job, layout, hardware("910B2"), devices_per_node=8)
    inside = estimate_step(job, layout, hardware("910B2"), devices_per_node=16)
    assert across.fsdp_exposed > 0 and across.step_time > inside.step_time

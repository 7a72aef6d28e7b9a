import pytest

from titan_npu.config.schema import ParallelConfig
from titan_npu.errors import LayoutError
from titan_npu.parallel import ParallelDims
from titan_npu.parallel.degrees import Degrees


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    dims = ParallelDims.from_config(ParallelConfig(tp_degree=8), world_size=64)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == (1, 8, 8, 1)
    assert dims.dp == 8 and dims.fsdp_enabled and dims.tp_enabled


def test_product_of_degrees_must_equal_world_size():
    with pytest.raises(LayoutError, match=r"multiply to 8 .* world size is 4"):
        ParallelDims.from_config(ParallelConfig(dp_shard=4, tp_degree=2), world_size=4)


def test_indivisible_world_size_names_the_divisors():
    with pytest.raises(LayoutError, match=r"not divisible .*divisors: \[1, 2, 3, 6\]"):
        ParallelDims.from_config(ParallelConfig(tp_degree=4), world_size=6)


def test_replicated_dp_without_fsdp():
    dims = ParallelDims.from_config(ParallelConfig(fsdp=False), world_size=2)
    assert dims.dp == 2 and not dims.fsdp_enabled


def test_fsdp_false_with_both_dp_dims_is_refused_as_ambiguous():
    with pytest.raises(LayoutError, match="ambiguous"):
        ParallelDims.from_config(ParallelConfig(fsdp=False, dp_replicate=2, dp_shard=2), world_size=4)


def test_a_single_process_runs_a_data_parallel_config_on_one_rank_and_warns(caplog):
    with caplog.at_level("WARNING", logger="titan_npu"):
        dims = ParallelDims.from_config(ParallelConfig(dp_shard=4), world_size=1)
    assert (dims.dp, dims.tp, dims.pp, dims.world_size) == (1, 1, 1, 1)
    assert "asks for 4 data-parallel ranks but this is a single process" in caplog.text


def test_a_single_process_still_refuses_tensor_or_pipeline_degrees():
    with pytest.raises(LayoutError, match="world size is 1"):
        ParallelDims.from_config(ParallelConfig(dp_shard=2, tp_degree=2), world_size=1)


def test_the_trainer_and_the_planner_hold_one_degrees_value():
    from titan_npu.config.schema import JobConfig
    from titan_npu.planner.layout import layout_from_config

    cfg = JobConfig()
    cfg.parallel = ParallelConfig(tp_degree=2, cp_degree=4, cp_mode="hybrid", cp_ulysses_degree=2, ep_degree=2)
    cfg.model.name, cfg.model.flavor = "qwen3_moe", "debug"
    dims = ParallelDims.from_config(cfg.parallel, world_size=16)
    layout = layout_from_config(cfg, 16)
    assert layout.degrees == dims.degrees == Degrees(dp_shard=2, tp=2, cp=4, ep=2, cp_mode="hybrid", cp_ulysses=2)
    # What follows from the degrees reads through on both, computed once.
    for name in ("world_size", "dp", "fsdp_shards", "efsdp", "expert_shards", "dp_mode", "hybrid_cp"):
        assert getattr(layout, name) == getattr(dims, name) == getattr(dims.degrees, name), name
    assert layout.rank_coordinates(13) == dims.degrees.rank_coordinates(13) == {
        "pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 2, "tp": 1}


def test_degrees_and_the_arithmetic_under_them_import_no_torch():
    import ast
    from pathlib import Path

    import titan_npu.parallel.arithmetic as arithmetic
    import titan_npu.parallel.degrees as degrees

    for module in (degrees, arithmetic):
        tree = ast.parse(Path(module.__file__).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {n for n in names if n.split(".")[0] == "torch"}, module.__name__


@pytest.mark.parametrize(("degrees", "message"), [
    (dict(dp_shard=3, ep=2), r"ep_degree=2 must divide dp_shard=3"),
    (dict(dp_shard=2, cp=2, ep=8), r"ep_degree=8 must divide dp_shard x cp_degree = 2 x 2 = 4"),
    (dict(cp=8, cp_mode="hybrid", cp_ulysses=3), r"cp_ulysses_degree=3: .* must divide cp_degree=8"),
    (dict(cp=2, cp_ulysses=2), r"cp_ulysses=2 needs parallel.cp_mode = \"hybrid\""),
    (dict(dp_replicate=2, dp_shard=2, fsdp=False), "ambiguous"),
    (dict(tp=0), r"tp=0 must be >= 1"),
])
def test_a_degrees_value_refuses_what_no_layout_can_run(degrees, message):
    with pytest.raises(LayoutError, match=message):
        Degrees(**degrees)


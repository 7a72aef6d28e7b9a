import pytest

from titan_npu.config.schema import ParallelConfig
from titan_npu.errors import LayoutError
from titan_npu.parallel import ParallelDims


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

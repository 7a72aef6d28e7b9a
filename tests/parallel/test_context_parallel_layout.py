"""parallel.cp_degree and cp_mode: the layouts context parallelism runs pass (Ulysses where the heads split over
the cp ranks), the ones it does not run yet are refused in one line that names the fix; the cp ranks join FSDP's
mesh; each cp rank's share of a batch and its loss weight add up to the whole batch's mean loss, also with ignored
labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_npu.config.loader import load_config
from titan_npu.config.schema import ModelConfig, ParallelConfig
from titan_npu.errors import ConfigError, LayoutError
from titan_npu.models.registry import build_model_args
from titan_npu.ops.cross_entropy import IGNORE_INDEX
from titan_npu.parallel import ParallelDims, validate_layout
from titan_npu.parallel.context_parallel import ContextParallelBatch, context_for
from titan_npu.trainer.loss import token_weight, valid_labels

from .test_layout import check, job


def test_context_parallel_layouts_of_this_slice_pass():
    check(2, cp_degree=2)
    check(4, cp_degree=4)
    check(4, cp_degree=2)  # dp_shard 2 x cp 2
    check(8, cp_degree=2, dp_replicate=2)  # HSDP 2 x (dp_shard 2 x cp 2)
    dims, cfg = job(2, cp_degree=2)
    cfg.validation.enable = cfg.compile.enable = True
    cfg.activation_checkpoint.mode = "full"
    validate_layout(dims, build_model_args(cfg.model), cfg)


def test_ulysses_layouts_whose_heads_split_over_cp_pass():
    # 4 query heads over 2 key/value heads: cp 2 splits both, cp 4 repeats each key/value head for two ranks.
    check(2, cp_degree=2, cp_mode="ulysses")
    check(4, cp_degree=4, cp_mode="ulysses")
    check(8, cp_degree=2, dp_replicate=2, cp_mode="ulysses")
    check(1, cp_mode="ulysses")  # no context parallelism: the mode is not used


@pytest.mark.parametrize(("world", "heads", "message"), [
    (8, (4, 2), r"cp_degree=8 ranks, but model.n_heads=4 / n_kv_heads=2 do not split 8 ways .* choose cp_degree "
                r"from 2, 4 or set parallel.cp_mode = \"ring\"$"),
    (2, (6, 3), r"cp_degree=2 ranks, but model.n_heads=6 / n_kv_heads=3 .* choose cp_degree from 3, 6 or set"),
])
def test_ulysses_with_heads_that_do_not_split_over_cp_is_refused(world, heads, message):
    model = ModelConfig(name="llama3", dim=96, n_layers=2, n_heads=heads[0], n_kv_heads=heads[1], vocab_size=512,
                        max_seq_len=64)
    with pytest.raises(LayoutError, match=message):
        check(world, model=model, cp_degree=world, cp_mode="ulysses")


@pytest.mark.parametrize(("world", "parallel", "message"), [
    (2, {"cp_degree": 2, "fsdp": False}, r"parallel.fsdp=false .* is not yet available; set parallel.fsdp = true"),
])
def test_what_context_parallelism_does_not_run_yet_is_refused(world, parallel, message):
    with pytest.raises(LayoutError, match=message):
        check(world, **parallel)


def test_context_parallel_with_tensor_parallel_layouts_pass():
    check(4, cp_degree=2, tp_degree=2)
    check(8, cp_degree=2, tp_degree=2)  # dp_shard 2 x cp 2 x tp 2
    check(4, cp_degree=2, tp_degree=2, cp_mode="ulysses")  # 4 / 2 heads: 2 / 1 per tp rank, split 2 ways


def test_context_parallel_with_pipeline_parallel_layouts_pass():
    check(4, cp_degree=2, pp_degree=2)
    check(8, cp_degree=2, pp_degree=2, tp_degree=2)


def test_ulysses_counts_the_heads_of_one_tensor_parallel_rank():
    with pytest.raises(LayoutError, match=r"n_heads=4 / n_kv_heads=2 \(2 / 1 per rank of tp_degree=2\) do not split "
                                          r"4 ways .* choose cp_degree from 2 or set parallel.cp_mode = \"ring\"$"):
        check(8, cp_degree=4, tp_degree=2, cp_mode="ulysses")


def test_a_cp_chunk_that_sequence_parallelism_cannot_split_over_tp_is_refused():
    with pytest.raises(LayoutError, match=r"seq_len=12 leaves each cp rank 6 positions, which sequence parallelism "
                                          r"cannot split over parallel.tp_degree=4; use a seq_len that is a multiple "
                                          r"of 8$"):
        check(8, cp_degree=2, tp_degree=4, seq_len=12)


def test_hybrid_layouts_whose_ulysses_groups_split_the_heads_pass():
    check(4, cp_degree=4, cp_mode="hybrid")  # Ulysses 2 x ring 2
    check(8, cp_degree=4, cp_mode="hybrid", tp_degree=2)  # 2 / 1 heads per tp rank over Ulysses groups of 2
    check(8, cp_degree=8, cp_mode="hybrid", cp_ulysses_degree=4)  # 2 key/value heads, each read by 2 ranks
    check(1, cp_mode="hybrid")  # no context parallelism: the mode is not used


@pytest.mark.parametrize(("world", "parallel", "message"), [
    (2, {"cp_degree": 2}, r"cp_ulysses_degree=2: hybrid .* must divide cp_degree=2 and lie strictly between 1 and "
                          r"it; use parallel.cp_mode = \"ring\" or \"ulysses\"$"),
    (4, {"cp_degree": 4, "cp_ulysses_degree": 4}, r"cp_ulysses_degree=4: .* choose it from \[2\]$"),
    (8, {"cp_degree": 8, "cp_ulysses_degree": 3}, r"cp_ulysses_degree=3: .* choose it from \[2, 4\]$"),
])
def test_hybrid_ulysses_groups_that_do_not_divide_cp_are_refused(world, parallel, message):
    with pytest.raises(LayoutError, match=message):
        check(world, cp_mode="hybrid", **parallel)


def test_hybrid_with_heads_that_do_not_split_over_a_ulysses_group_is_refused():
    model = ModelConfig(name="llama3", dim=96, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=512, max_seq_len=64)
    with pytest.raises(LayoutError, match=r"cp_mode=\"hybrid\" splits the attention heads over "
                                          r"parallel.cp_ulysses_degree=2 ranks, .* choose cp_ulysses_degree from 3, 6 "
                                          r"or set parallel.cp_mode = \"ring\"$"):
        check(4, model=model, cp_degree=4, cp_mode="hybrid")


def test_expert_parallel_ranks_are_borrowed_from_dp_shard_x_cp():
    moe = ModelConfig(name="qwen3_moe", flavor="debug")
    check(2, model=moe, cp_degree=2, ep_degree=2)  # the experts split over both cp ranks
    check(4, model=moe, cp_degree=2, ep_degree=4)  # over dp_shard 2 x cp 2
    check(4, model=moe, cp_degree=2, ep_degree=2)  # over 2 of them, FSDP over the other 2
    with pytest.raises(LayoutError, match=r"ep_degree=8 must divide dp_shard x cp_degree = 2 x 2 = 4 .* choose "
                                          r"ep_degree from \[1, 2, 4\]$"):
        check(4, model=moe, cp_degree=2, ep_degree=8)


def test_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(LayoutError, match=r"seq_len=60 does not split into 2 \* parallel.cp_degree = 8 equal "
                                          r"chunks .* a multiple of 8"):
        check(4, cp_degree=4, seq_len=60)


def test_cp_ranks_count_in_the_world_size():
    with pytest.raises(LayoutError, match=r"multiply to 8 .* x cp=2\) but the world size is 4"):
        ParallelDims.from_config(ParallelConfig(dp_shard=4, cp_degree=2), 4)
    dims = ParallelDims.from_config(ParallelConfig(cp_degree=2), 8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.dp_mode) == (4, 2, 4, "fsdp")
    # cp alone still shards the parameters over the cp ranks (and so averages their gradients).
    alone = ParallelDims.from_config(ParallelConfig(cp_degree=2), 2)
    assert (alone.dp, alone.dp_enabled, alone.fsdp_enabled, alone.dp_mode) == (1, True, True, "fsdp")
    assert "cp=2" in alone.describe()


def test_cp_settings_are_checked_when_the_config_loads():
    assert load_config(None, ["--parallel.cp_degree=2", "--parallel.cp_mode=Ring"]).parallel.cp_mode == "ring"
    with pytest.raises(ConfigError, match="parallel.cp_degree"):
        load_config(None, ["--parallel.cp_degree=0"])
    with pytest.raises(ConfigError, match="parallel.cp_mode = 'zigzag' is not a known context parallel mode"):
        load_config(None, ["--parallel.cp_mode=zigzag"])


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_shares_of_the_loss_add_up_to_the_batch_mean_with_ignored_labels(cp):
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 16, 11, generator=g), torch.randint(0, 11, (2, 16), generator=g)
    labels[0, :7] = IGNORE_INDEX  # uneven counts across the chunks
    inputs = torch.arange(32).view(2, 16)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    shares = []
    for rank in range(cp):
        local_inputs, local_labels = ContextParallelBatch(rank, cp).split(inputs, labels)
        weight = token_weight(valid_labels(local_labels), cp, valid_labels(labels))
        local_logits = logits[torch.arange(2)[:, None], local_inputs % 16]  # the rows of this rank's positions
        local = F.cross_entropy(local_logits.flatten(0, 1), local_labels.flatten(), ignore_index=IGNORE_INDEX)
        shares.append(local * weight)
    # The gradient average over the cp ranks: the mean of the weighted local losses.
    torch.testing.assert_close(torch.stack(shares).mean(), want)


def test_a_cp_mode_without_an_attention_context_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"cp_mode = 'striped' has no attention context; use one of ring, ulysses, "
                                         r"hybrid$"):
        context_for("striped", None)

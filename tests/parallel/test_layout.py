"""validate_layout and ParallelDims: impossible layouts are refused with the numbers and a fix, before any model
is built; valid ones (the guides' 7B / 70B layouts) pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_npu.config.schema import JobConfig, ModelConfig, ParallelConfig
from titan_npu.errors import LayoutError
from titan_npu.models.registry import build_model_args
from titan_npu.parallel import ParallelDims, validate_layout
from titan_npu.parallel.layout import pp_microbatches, pp_stages_per_rank


def job(world: int, model: ModelConfig | None = None, batch_size: int = 4, accum: int = 1, seq_len: int = 64,
        **parallel) -> tuple[ParallelDims, JobConfig]:
    cfg = JobConfig(model=model or ModelConfig(name="llama3", flavor="debug", dim=64, n_layers=4, n_heads=4,
                                               n_kv_heads=2, vocab_size=512, max_seq_len=64))
    cfg.training.batch_size, cfg.training.gradient_accumulation_steps, cfg.training.seq_len = batch_size, accum, seq_len
    cfg.parallel = ParallelConfig(**parallel)
    return ParallelDims.from_config(cfg.parallel, world), cfg


def check(world: int, **kwargs) -> None:
    dims, cfg = job(world, **kwargs)
    validate_layout(dims, build_model_args(cfg.model), cfg)


def test_guide_layouts_pass():
    # 7B on 4 cards with FSDP; 70B on 64 cards with TP=8 + FSDP; 70B with TP=8 x PP=4 x FSDP.
    check(4, model=ModelConfig(name="llama2", flavor="7B"), seq_len=4096)
    check(64, model=ModelConfig(name="llama3", flavor="70B"), seq_len=8192, tp_degree=8)
    check(64, model=ModelConfig(name="llama3", flavor="70B"), seq_len=8192, tp_degree=8, pp_degree=4, batch_size=8)


def test_tp_not_dividing_heads_names_the_valid_degrees():
    model = ModelConfig(name="llama3", dim=96, n_layers=2, n_heads=6, n_kv_heads=6, vocab_size=512, max_seq_len=64)
    with pytest.raises(LayoutError, match=r"tp_degree=4 does not divide model.n_heads=6: .*from 1, 2\)"):
        check(4, model=model, tp_degree=4)


def test_tp_not_dividing_kv_heads_is_refused():
    with pytest.raises(LayoutError, match=r"tp_degree=4 does not divide model.n_kv_heads=2: .*from 1, 2\)"):
        check(4, tp_degree=4)


def test_vocab_not_divisible_by_tp_gives_the_padded_size():
    model = ModelConfig(name="llama3", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=32001, max_seq_len=64)
    with pytest.raises(LayoutError, match=r"vocab_size=32001 .* set model.vocab_size = 32004"):
        check(4, model=model, tp_degree=4)


def test_sequence_not_divisible_by_tp_is_refused():
    with pytest.raises(LayoutError, match=r"seq_len=63 is not divisible by parallel.tp_degree=2"):
        check(2, tp_degree=2, seq_len=63)


def test_more_pipeline_stages_than_layers_is_refused():
    with pytest.raises(LayoutError, match=r"n_layers=4 is fewer than the 8 pipeline stages .*pp_degree=4 x 2"):
        check(4, pp_degree=4, pp_schedule="Interleaved1F1B", batch_size=8)


def test_microbatches_fewer_than_pipeline_ranks_is_refused():
    with pytest.raises(LayoutError, match=r"pp_microbatches=1 is fewer than the pp_degree=2"):
        check(2, pp_degree=2, pp_microbatches=1)


def test_microbatches_must_divide_the_local_batch_and_the_fix_lists_choices():
    with pytest.raises(LayoutError, match=r"= pp_degree x 2 = 4\) does not divide the 6 sequences .*one of 2, 3, 6"):
        check(2, pp_degree=2, batch_size=3, accum=2)


def test_default_microbatches_and_stages_per_rank():
    dims, cfg = job(4, pp_degree=4, pp_schedule="Interleaved1F1B")
    assert pp_microbatches(cfg, dims) == 8 and pp_stages_per_rank(cfg) == 2
    dims, cfg = job(2, pp_degree=2, pp_microbatches=6)
    assert pp_microbatches(cfg, dims) == 6 and pp_stages_per_rank(cfg) == 1


def test_single_stage_schedules_refuse_virtual_stages():
    with pytest.raises(LayoutError, match=r"pp_schedule=1F1B runs one stage per rank"):
        check(2, pp_degree=2, pp_virtual_stages=2)
    with pytest.raises(LayoutError, match=r"Interleaved1F1B needs at least 2 stages per rank"):
        check(2, pp_degree=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=1)


def test_fp16_with_pipeline_is_refused():
    dims, cfg = job(2, pp_degree=2)
    cfg.training.dtype = "fp16"
    with pytest.raises(LayoutError, match="fp16 .* use bf16"):
        validate_layout(dims, build_model_args(cfg.model), cfg)


def test_validation_is_refused_with_pipeline_parallelism():
    dims, cfg = job(2, pp_degree=2)
    cfg.validation.enable = True
    with pytest.raises(LayoutError, match="validation.enable=true is not available with pipeline parallelism"):
        validate_layout(dims, build_model_args(cfg.model), cfg)
    dims, cfg = job(2, tp_degree=2)
    cfg.validation.enable = True
    validate_layout(dims, build_model_args(cfg.model), cfg)


def test_cpu_offload_needs_fsdp():
    with pytest.raises(LayoutError, match="cpu_offload=true needs FSDP"):
        check(2, fsdp=False, cpu_offload=True)
    check(2, cpu_offload=True)


def test_world_size_must_be_the_product_of_the_degrees():
    with pytest.raises(LayoutError, match=r"multiply to 8 .* world size is 4"):
        ParallelDims.from_config(ParallelConfig(dp_shard=2, tp_degree=2, pp_degree=2), 4)


@pytest.mark.parametrize(("parallel", "mode"), [
    ({}, "fsdp"), ({"fsdp": False}, "replicate"), ({"dp_replicate": 2}, "hsdp"), ({"tp_degree": 4}, "none"),
    ({"dp_replicate": 4, "fsdp": False, "dp_shard": 1}, "replicate"),
])
def test_data_parallel_mode_follows_the_degrees(parallel, mode):
    dims = ParallelDims.from_config(ParallelConfig(**parallel), 4)
    assert dims.dp_mode == mode
    assert dims.params_are_sharded == (mode != "none" or dims.tp > 1)


def test_train_py_refuses_an_impossible_layout_in_one_line(tmp_path: Path):
    train_py = Path(__file__).resolve().parents[2] / "train.py"
    proc = subprocess.run(
        [sys.executable, str(train_py), "--parallel.tp_degree=3", f"--metrics.log_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, TITAN_DEVICE="cpu"),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("LayoutError: world size 1 is not divisible"), proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written

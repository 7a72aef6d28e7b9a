"""Document masking (data.document_mask, data.reset_position_ids) under tensor and pipeline parallelism.

TP (with sequence parallelism): each tp rank attends over its heads on the whole gathered sequence, within each
query's document. Every family -- Llama 3, Qwen3 (q/k norms, tied), Qwen3-MoE (MoE tensor parallelism), DeepSeek-V3
(MLA) -- at tp 2 gives one process's masked logits, and a token's output does not change when another document of
its window changes; the dry run takes document masking at tp 2 and at pp 2.
PP: the trainer splits the batch's documents per microbatch (Documents.split, host ends included) and every stage's
forward of microbatch i gets microbatch i's by argument.
Training runs -- tp 2, pp 2 (1F1B; Interleaved1F1B with full activation checkpointing, which recomputes each
microbatch's blocks in its backward; Qwen3-MoE's, whose stages also pass on routing sums), and on 4 ranks
fsdp 2 x tp 2, ring cp 2 x tp 2 and ring cp 2 x pp 2 -- give one process's per-step losses (fp32, 1e-5 relative)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from titan_npu.ops.documents import Documents

from .harness import losses, run_pool, tiny_run, write_tokens
from .test_document_mask import BOUNDS, SEQ, STARTS, _tokens, _with_first_document_changed

ROOT = Path(__file__).parents[2]
SMALL = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.vocab_size=512", "--model.max_seq_len=64"]
# Each family with what sets its attention or feed-forward apart under tensor parallelism: (config file, overrides).
FAMILIES = {
    "llama3": (None, ["--model.name=llama3", *SMALL, "--model.n_layers=4"]),  # a layer per interleaved stage
    "qwen3": (None, ["--model.name=qwen3", "--model.flavor=debug", *SMALL, "--model.head_dim=32"]),
    "qwen3_moe": (None, ["--model.name=qwen3_moe", "--model.flavor=debug", *SMALL, "--model.head_dim=32"]),
    "deepseek_v3": (ROOT / "configs" / "debug_deepseek.toml", ["--model.dim=64", "--model.n_layers=2",
                                                               "--model.max_seq_len=64"]),
}
STEPS = 3
RTOL = 1e-5
MASKED = ["--data.document_mask=true", "--data.reset_position_ids=true", f"--training.max_steps={STEPS}"]


def _check_tensor_parallel(workdir: Path, family: str) -> None:
    """At tp = world size: the masked logits equal one process's, and stay put where the other documents change;
    a file in workdir says the rank got through."""
    import torch.distributed as dist

    from titan_npu.config.loader import load_config
    from titan_npu.models.registry import build_model, build_model_args, spec_of
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.parallelize import materialize

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    config, overrides = FAMILIES[family]
    cfg = load_config(config, [*overrides, "--training.dtype=fp32", "--parallel.dp_shard=1",
                               f"--parallel.tp_degree={dist.get_world_size()}", "--parallel.loss_parallel=false",
                               "--data.document_mask=true", "--data.reset_position_ids=true"])
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    dims.build_mesh("cpu")
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = build_model(args)
    model = spec_of(args).parallelize(model, dims, cfg)
    materialize(model, torch.device("cpu"), cfg)
    reference = build_model(args)
    reference.init_weights(seed=cfg.training.seed)
    documents = Documents.from_starts(STARTS, SEQ, reset_positions=True)
    tokens, changed = _tokens(0), _with_first_document_changed(_tokens(0))
    with torch.no_grad():
        want = reference(tokens, documents=documents)
        got = model(tokens, documents=documents)
        got_changed = model(changed, documents=documents)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family} tp: {m}")
    later = torch.stack([torch.arange(SEQ) >= bounds[1] for bounds in BOUNDS])
    torch.testing.assert_close(got_changed[later], got[later], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got_changed[~later], got[~later], atol=1e-3)
    (workdir / f"checked_{family}_rank{dist.get_rank()}").touch()


def _family_run(workdir: Path, name: str, family: str, batch_size: int = 4) -> list[str]:
    """The harness's tiny run with `family`'s model and document masking."""
    return tiny_run(workdir, name, batch_size) + MASKED + FAMILIES[family][1]


TP2, PP2 = ["--parallel.tp_degree=2", "--parallel.dp_shard=1"], ["--parallel.pp_degree=2", "--parallel.dp_shard=1"]
# name: (family, layout) of the 2-rank runs.
RUNS = {
    "llama3_tp2": ("llama3", TP2),
    "qwen3_moe_tp2": ("qwen3_moe", TP2),
    "llama3_pp2_1f1b": ("llama3", [*PP2, "--parallel.pp_schedule=1F1B"]),
    "llama3_pp2_interleaved_ac": ("llama3", [*PP2, "--parallel.pp_schedule=Interleaved1F1B",
                                             "--activation_checkpoint.mode=full"]),
    "qwen3_moe_pp2": ("qwen3_moe", [*PP2, "--parallel.pp_schedule=1F1B"]),  # routing sums between the stages too
}
WIDE_RUNS = {  # 4 ranks, Llama 3
    "llama3_fsdp2_tp2": (2, ["--parallel.tp_degree=2", "--parallel.dp_shard=2"]),
    "llama3_cp2_tp2": (4, ["--parallel.tp_degree=2", "--parallel.cp_degree=2"]),
    "llama3_cp2_pp2": (4, ["--parallel.pp_degree=2", "--parallel.cp_degree=2"]),
}


@pytest.fixture(scope="module")
def masked_tp_runs(tmp_path_factory) -> Path:
    """The model-level checks of every family and the tp 2 and pp 2 training runs in one 2-rank pool, the 4-rank
    layouts in another, and the one-process runs they are compared with."""
    workdir = tmp_path_factory.mktemp("document_mask_tp_pp")
    write_tokens(workdir / "tokens.jsonl")
    run_pool(2, [*[partial(_check_tensor_parallel, workdir, family) for family in FAMILIES],
                 *[_family_run(workdir, name, family) + layout for name, (family, layout) in RUNS.items()]])
    run_pool(4, [_family_run(workdir, name, "llama3", batch_size) + layout
                 for name, (batch_size, layout) in WIDE_RUNS.items()])
    families = dict.fromkeys(family for family, _ in RUNS.values())
    run_pool(1, [_family_run(workdir, f"{family}_one_process", family) for family in families])
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_attention_stops_at_documents_like_one_process(masked_tp_runs, family):
    # _check_tensor_parallel compared each rank's logits (an assertion there fails the pool and this fixture).
    assert all((masked_tp_runs / f"checked_{family}_rank{rank}").exists() for rank in range(2))


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*RUNS, *WIDE_RUNS])
def test_masked_tensor_and_pipeline_parallel_losses_match_one_process(masked_tp_runs, name):
    want = losses(masked_tp_runs, f"{RUNS.get(name, ('llama3',))[0]}_one_process")
    assert len(want) == STEPS
    assert losses(masked_tp_runs, name) == pytest.approx(want, rel=RTOL)


@pytest.mark.parametrize("layout", ["tp_degree", "pp_degree"])
def test_the_dry_run_takes_document_masking_under_tensor_or_pipeline_parallelism(capsys, layout):
    from titan_npu.train import main

    code = main(["--config", str(ROOT / "configs" / "debug.toml"), "--dry-run", "--world-size", "2", "--rank", "1",
                 "--training.seq_len", "64", "--training.batch_size", "4", f"--parallel.{layout}", "2",
                 "--data.document_mask", "true", "--data.reset_position_ids", "true"])
    out = capsys.readouterr().out
    assert code == 0 and "every local shard matches the plan" in out


def test_the_microbatches_documents_are_those_of_their_rows():
    # Two batches of two rows, concatenated and cut into 4 microbatches of one row (and 2 of two rows): each is what
    # the loader builds for its rows alone, host ends counted from its own first position.
    rows = [STARTS[0], STARTS[1], [5, 6], []]
    batches = [Documents.from_starts(rows[:2], SEQ, True), Documents.from_starts(rows[2:], SEQ, True)]
    whole = Documents.cat(batches)
    for n in (4, 2):
        size = len(rows) // n
        for i, part in enumerate(whole.split(n)):
            alone = Documents.from_starts(rows[i * size:(i + 1) * size], SEQ, True)
            assert part.cu_seqlens == alone.cu_seqlens
            assert torch.equal(part.ids, alone.ids) and torch.equal(part.positions, alone.positions)


def test_deepseek_multi_token_prediction_with_document_masking_is_refused_in_one_line():
    from titan_npu.config.loader import load_config
    from titan_npu.errors import LayoutError
    from titan_npu.models.deepseek_v3.parallelize import check_deepseek_layout
    from titan_npu.models.registry import build_model_args
    from titan_npu.parallel import ParallelDims

    config, overrides = FAMILIES["deepseek_v3"]
    cfg = load_config(config, [*overrides, "--model.mtp_depth=1", "--data.document_mask=true"])
    with pytest.raises(LayoutError, match="model.mtp_depth=1 with data.document_mask = true") as error:
        check_deepseek_layout(ParallelDims.from_config(cfg.parallel, 1), build_model_args(cfg.model), cfg)
    assert "\n" not in str(error.value) and "set model.mtp_depth = 0 or data.document_mask = false" in str(error.value)

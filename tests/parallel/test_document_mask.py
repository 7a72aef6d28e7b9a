"""Document masking (data.document_mask, data.reset_position_ids): attention stops at the documents of a packed
window, in one process and under context, tensor and pipeline parallelism.

A token's output does not change when the other documents of its window change, in one process, under context
parallelism (ring and Ulysses, cp 2) and under tensor parallelism (tp 2, sequence parallel: each tp rank's heads over
the whole gathered window) for every family -- Llama 3, Qwen3 (q/k norms, tied), Qwen2 (biases), Qwen3-MoE (MoE
tensor parallelism), DeepSeek-V3 (MLA) -- whose masked logits also equal one process's; the masked model equals the same
documents run one by one; ring attention with documents on the NPU block kernels (fake torch_npu) equals masked
SDPA. Under pipeline parallelism the trainer splits the batch's documents per microbatch (Documents.split, host ends
included) and every stage's forward of microbatch i gets microbatch i's by argument.
Training runs give one process's per-step losses (fp32, 1e-5 relative): cp 2 (ring, Ulysses; the validation loss
too), tp 2 (Llama 3, Qwen3-MoE), pp 2 (1F1B: Llama 3, Qwen3-MoE, whose stages also pass on routing sums;
Interleaved1F1B with full activation checkpointing, which recomputes each microbatch's blocks in its backward after
later microbatches' forwards) and, with -m slow (4 ranks), fsdp 2 x tp 2, ring cp 2 x tp 2, ring cp 2 x pp 2 and
tp 2 x pp 2.
The dry run takes document masking at tp 2 and pp 2."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_npu.models.llama import LlamaArgs, Transformer
from titan_npu.ops.documents import Documents
from titan_npu.parallel.context_parallel import shard_sequence

from .harness import losses, run_pool, tensor_parallel_pair, tiny_run, write_tokens

ROOT = Path(__file__).parents[2]
SEQ = 32
STEPS = 3
RTOL = 1e-5
# Row 0: documents [0, 7), [7, 20), [20, 32); row 1: [0, 13), [13, 32) -- boundaries inside chunks and at none.
STARTS = [np.array([7, 20]), np.array([0, 13, SEQ])]
BOUNDS = [[0, 7, 20, SEQ], [0, 13, SEQ]]


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=160, max_seq_len=64,
                     rope_theta=10000.0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _with_first_document_changed(tokens: torch.Tensor) -> torch.Tensor:
    """The batch with other tokens in each row's first document."""
    changed = tokens.clone()
    for row, bounds in enumerate(BOUNDS):
        changed[row, : bounds[1]] = _tokens(99)[row, : bounds[1]]
    return changed


def _later_documents(x: torch.Tensor) -> list[torch.Tensor]:
    """Each row's positions after its first document."""
    return [x[row, bounds[1]:] for row, bounds in enumerate(BOUNDS)]


@pytest.mark.parametrize("reset_positions", [False, True], ids=["positions", "reset_positions"])
def test_a_tokens_output_does_not_change_when_the_other_documents_change(reset_positions):
    model, documents = _model(), Documents.from_starts(STARTS, SEQ, reset_positions)
    tokens = _tokens(0)
    with torch.no_grad():
        before = model(tokens, documents=documents)
        after = model(_with_first_document_changed(tokens), documents=documents)
        unmasked = model(_with_first_document_changed(tokens))
    for a, b, c in zip(_later_documents(before), _later_documents(after), _later_documents(model(tokens).detach()),
                       strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(a, c, atol=1e-3)  # the mask is what keeps them apart
    assert not torch.allclose(model(tokens).detach(), unmasked)


def test_the_masked_model_equals_the_same_documents_run_separately():
    model, documents = _model(), Documents.from_starts(STARTS, SEQ, reset_positions=True)
    tokens = _tokens(0)
    with torch.no_grad():
        packed = model(tokens, documents=documents)
        for row, bounds in enumerate(BOUNDS):
            for lo, hi in zip(bounds, bounds[1:]):
                alone = model(tokens[row:row + 1, lo:hi])[0]
                torch.testing.assert_close(packed[row, lo:hi], alone, rtol=1e-5, atol=1e-5)


def _check_context_parallel(workdir: Path, mode: str, reset_positions: bool) -> None:
    """Under cp = world size: each rank's logits of its chunks equal one process's masked logits there, and stay
    put where the other documents change; a file in workdir says the rank got through."""
    import torch.distributed as dist

    from titan_npu.parallel.context_parallel import context_for

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, documents = _model(), Documents.from_starts(STARTS, SEQ, reset_positions)
    tokens, changed = _tokens(0), _with_first_document_changed(_tokens(0))
    with torch.no_grad():
        want = shard_sequence(model(tokens, documents=documents), rank, cp)
        for layer in model.layers.values():
            layer.attention.context = context_for(mode, dist.group.WORLD)
        got = model(shard_sequence(tokens, rank, cp), documents=documents)
        got_changed = model(shard_sequence(changed, rank, cp), documents=documents)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{mode} rank {rank}: {m}")
    later = shard_sequence(torch.stack([torch.arange(SEQ) >= bounds[1] for bounds in BOUNDS]), rank, cp)
    torch.testing.assert_close(got_changed[later], got[later], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got_changed[~later], got[~later], atol=1e-3)
    (workdir / f"checked_{mode}_{reset_positions}_rank{rank}").touch()


def _check_ring_on_npu_blocks(workdir: Path) -> None:
    """Ring attention with documents on the NPU block kernels (the fake torch_npu on CPU tensors, installed for this
    check): the output and dq, dk, dv equal masked SDPA on the whole sequence."""
    import sys

    import torch.distributed as dist

    from titan_npu.ops import attention_blocks, reference
    from titan_npu.parallel.ring_attention import ring_attention

    sys.path.insert(0, str(Path(__file__).parents[1] / "npu" / "fake_torch_npu"))
    import torch_npu  # noqa: F401  (the fake: npu_fusion_attention and its grad on the CPU)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    documents = Documents.from_starts(STARTS, SEQ, reset_positions=False)
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, SEQ, h, 16, generator=g) for h in (4, 2, 2, 4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*whole, documents=documents)
    want.backward(dout)
    local = [shard_sequence(t, rank, cp).requires_grad_() for t in (q, k, v)]
    choose = attention_blocks.block_kernels
    attention_blocks.block_kernels = lambda device_type: choose("npu")
    try:
        out = ring_attention(*local, dist.group.WORLD, documents)
        out.backward(shard_sequence(dout, rank, cp))
    finally:
        attention_blocks.block_kernels = choose
    for got, expected in zip((out, *(t.grad for t in local)), (want, *(t.grad for t in whole)), strict=True):
        torch.testing.assert_close(got.detach(), shard_sequence(expected.detach(), rank, cp), rtol=1e-5, atol=2e-6)
    assert torch_npu.calls["npu_fusion_attention_grad"] == cp  # one block per ring step
    (workdir / f"checked_npu_blocks_rank{rank}").touch()


SMALL = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.vocab_size=512", "--model.max_seq_len=64"]
# Each family with what sets its attention or feed-forward apart under tensor parallelism: (config file, overrides).
FAMILIES = {
    "llama3": (None, ["--model.name=llama3", *SMALL]),
    "qwen3": (None, ["--model.name=qwen3", "--model.flavor=debug", *SMALL, "--model.head_dim=32"]),
    "qwen2": (None, ["--model.name=qwen2", "--model.flavor=debug", *SMALL]),  # q/k/v biases cut with their columns
    # Without the load-balancing loss, which a pipeline pools per microbatch (one process: over the whole batch).
    "qwen3_moe": (None, ["--model.name=qwen3_moe", "--model.flavor=debug", *SMALL, "--model.head_dim=32",
                         "--model.router_aux_loss_coef=0"]),
    "deepseek_v3": (ROOT / "configs" / "debug_deepseek.toml", ["--model.dim=64", "--model.n_layers=2",
                                                               "--model.max_seq_len=64"]),
}


def _check_tensor_parallel(workdir: Path, family: str) -> None:
    """At tp = world size: the masked logits equal one process's, and stay put where the other documents change;
    a file in workdir says the rank got through."""
    import torch.distributed as dist

    from titan_npu.config.loader import load_config

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    config, overrides = FAMILIES[family]
    cfg = load_config(config, [*overrides, "--training.dtype=fp32", "--parallel.dp_shard=1",
                               f"--parallel.tp_degree={dist.get_world_size()}", "--parallel.loss_parallel=false",
                               "--data.document_mask=true", "--data.reset_position_ids=true"])
    model, reference, _ = tensor_parallel_pair(cfg)
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


def _layout_run(workdir: Path, name: str, family: str, batch_size: int = 4) -> list[str]:
    """The tiny run (Llama 3: the harness's model, 4 layers: one per interleaved stage; else `family`'s) with
    document masking and masked_one_process's training data."""
    model = [] if family == "llama3" else FAMILIES[family][1]
    return tiny_run(workdir, name, batch_size) + LAYOUT_MASKED + model


TP2, PP2 = ["--parallel.tp_degree=2", "--parallel.dp_shard=1"], ["--parallel.pp_degree=2", "--parallel.dp_shard=1"]
# masked_one_process's training: the same held-out fraction, without the validation (not under test here).
LAYOUT_MASKED = ["--data.document_mask=true", "--data.reset_position_ids=true", f"--training.max_steps={STEPS}",
                 "--data.val_fraction=0.1"]
# name: (family, layout) of the 2-rank runs.
LAYOUT_RUNS = {
    "llama3_tp2": ("llama3", TP2),
    "qwen3_moe_tp2": ("qwen3_moe", TP2),
    "llama3_pp2_1f1b": ("llama3", [*PP2, "--parallel.pp_schedule=1F1B"]),
    "llama3_pp2_interleaved_ac": ("llama3", [*PP2, "--parallel.pp_schedule=Interleaved1F1B",
                                             "--activation_checkpoint.mode=full"]),
    "qwen3_moe_pp2": ("qwen3_moe", [*PP2, "--parallel.pp_schedule=1F1B"]),  # routing sums between the stages too
}
WIDE_RUNS = {  # 4 ranks, Llama 3: name: (batch size per data-parallel rank, layout)
    "llama3_fsdp2_tp2": (2, ["--parallel.tp_degree=2", "--parallel.dp_shard=2"]),
    "llama3_cp2_tp2": (4, ["--parallel.tp_degree=2", "--parallel.cp_degree=2"]),
    "llama3_cp2_pp2": (4, ["--parallel.pp_degree=2", "--parallel.cp_degree=2"]),
    "llama3_tp2_pp2": (4, ["--parallel.tp_degree=2", "--parallel.pp_degree=2"]),
}


CHECKS = [(mode, reset) for mode in ("ring", "ulysses") for reset in (False, True)]
# Validation at the last step on 2 held-out batches: the validation loader carries documents too.
MASKED = ["--data.document_mask=true", "--data.reset_position_ids=true", f"--training.max_steps={STEPS}",
          "--validation.enable=true", f"--validation.interval={STEPS}", "--validation.steps=2",
          "--data.val_fraction=0.1"]
RUNS = {"masked_cp2_ring": ["--parallel.cp_degree=2"],
        "masked_cp2_ulysses": ["--parallel.cp_degree=2", "--parallel.cp_mode=ulysses"]}


@pytest.fixture(scope="module")
def masked_runs(tmp_path_factory) -> Path:
    """The model-level checks and the cp 2, tp 2 and pp 2 runs with document masking in one 2-rank pool, and the
    one-process runs they are compared with."""
    workdir = tmp_path_factory.mktemp("document_mask")
    write_tokens(workdir / "tokens.jsonl")
    checks = [partial(_check_context_parallel, workdir, mode, reset) for mode, reset in CHECKS]
    checks += [partial(_check_tensor_parallel, workdir, family) for family in FAMILIES]
    # The NPU check last: it imports the fake torch_npu into the pool's processes.
    run_pool(2, [*checks, *[tiny_run(workdir, name) + MASKED + extra for name, extra in RUNS.items()],
                 *[_layout_run(workdir, name, family) + layout for name, (family, layout) in LAYOUT_RUNS.items()],
                 partial(_check_ring_on_npu_blocks, workdir)])
    run_pool(1, [tiny_run(workdir, "masked_one_process") + MASKED, _layout_run(workdir, "qwen3_moe_one_process",
                                                                                 "qwen3_moe")])
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "reset"), CHECKS)
def test_context_parallel_attention_stops_at_documents_like_one_process(masked_runs, mode, reset):
    # _check_context_parallel compared each rank's logits (an assertion there fails the pool and this fixture).
    assert all((masked_runs / f"checked_{mode}_{reset}_rank{rank}").exists() for rank in range(2))


@pytest.mark.distributed
def test_ring_attention_with_documents_on_the_npu_block_kernels_equals_masked_sdpa(masked_runs):
    # _check_ring_on_npu_blocks compared each rank's output and gradients (an assertion there fails the pool).
    assert all((masked_runs / f"checked_npu_blocks_rank{rank}").exists() for rank in range(2))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_masked_context_parallel_losses_match_one_process(masked_runs, name):
    want = losses(masked_runs, "masked_one_process")
    assert len(want) == STEPS
    assert losses(masked_runs, name) == pytest.approx(want, rel=RTOL)
    want_val = _validation_losses(masked_runs, "masked_one_process")
    assert len(want_val) == 1 and _validation_losses(masked_runs, name) == pytest.approx(want_val, rel=RTOL)


def _validation_losses(workdir: Path, name: str) -> list[float]:
    lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
    return [r["val_loss"] for r in map(json.loads, filter(str.strip, lines)) if "val_loss" in r]


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_attention_stops_at_documents_like_one_process(masked_runs, family):
    # _check_tensor_parallel compared each rank's logits (an assertion there fails the pool and this fixture).
    assert all((masked_runs / f"checked_{family}_rank{rank}").exists() for rank in range(2))


def _one_process(family: str) -> str:
    return "masked_one_process" if family == "llama3" else f"{family}_one_process"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUT_RUNS))
def test_masked_tensor_and_pipeline_parallel_losses_match_one_process(masked_runs, name):
    want = losses(masked_runs, _one_process(LAYOUT_RUNS[name][0]))
    assert len(want) == STEPS
    assert losses(masked_runs, name) == pytest.approx(want, rel=RTOL)


@pytest.fixture(scope="module")
def wide_masked_runs(masked_runs) -> Path:
    """The 4-rank layouts with document masking, beside the runs they are compared with."""
    run_pool(4, [_layout_run(masked_runs, name, "llama3", batch_size) + layout
                 for name, (batch_size, layout) in WIDE_RUNS.items()])
    return masked_runs


@pytest.mark.slow  # 4 processes on a small host; tp 2 and pp 2 above are the default run's check of the same paths
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(WIDE_RUNS))
def test_masked_four_rank_layouts_losses_match_one_process(wide_masked_runs, name):
    want = losses(wide_masked_runs, "masked_one_process")
    assert len(want) == STEPS
    assert losses(wide_masked_runs, name) == pytest.approx(want, rel=RTOL)


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

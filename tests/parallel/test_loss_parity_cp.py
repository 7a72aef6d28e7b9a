"""Context parallelism, ring, Ulysses or hybrid, alone or with FSDP, HSDP, TP or PP, trains exactly like one
process: each cp rank holds its load-balanced chunks of the same sequences, and from the same training.seed and
global batch the per-step losses equal one process's to 1e-5 relative (gradient norms to 1e-4) over 10 fp32
deterministic steps (gloo); so does the seq-2048 command of docs/long_context.md on the dense and the MoE debug
configs; a CP run saved and resumed continues bit for bit, and a checkpoint resumes exactly under another cp degree
(cp 2 -> 1, cp 2 -> 4, 1 -> cp 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .harness import (
    STEPS,
    Case,
    config_run,
    initial_weights,
    losses,
    losses_by_step,
    marked_slow,
    run_here,
    run_pool,
    selected_ids,
    tiny_run,
)

pytestmark = pytest.mark.distributed

RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4

# Validation every 5 steps on 2 held-out batches (a tenth of the documents, so its own reference run).
VALIDATION = ["--validation.enable=true", "--validation.interval=5", "--validation.steps=2",
              "--data.val_fraction=0.1"]

TWO_RANKS = [
    Case("cp2", ["--parallel.cp_degree=2"], "ref_b4"),
    # The loss from the whole logits instead of the chunked projection.
    Case("cp2_whole_logits", ["--parallel.cp_degree=2", "--training.loss_chunk_tokens=0"], "ref_b4"),
    Case("cp2_ac_full", ["--parallel.cp_degree=2", "--activation_checkpoint.mode=full"], "ref_b4"),
    Case("cp2_compile", ["--parallel.cp_degree=2", "--compile.enable=true"], "ref_b4"),
    Case("cp2_ac_selective_ops", ["--parallel.cp_degree=2", "--activation_checkpoint.mode=selective",
                                  "--activation_checkpoint.selective_ops=true"], "ref_b4"),
    # Two micro-batches of 2 per step, each split over the cp ranks.
    Case("cp2_grad_accum", ["--parallel.cp_degree=2", "--training.batch_size=2",
                            "--training.gradient_accumulation_steps=2"], "ref_b4"),
    Case("cp2_validation", ["--parallel.cp_degree=2", *VALIDATION], "ref_b4_validation"),
    # Qwen3 (q/k norms, head size apart from dim / n_heads, tied) and Qwen2 (q/k/v biases, tied).
    Case("qwen3_cp2", ["--parallel.cp_degree=2"], "ref_b4", "qwen3"),
    Case("qwen2_cp2", ["--parallel.cp_degree=2"], "ref_b4", "qwen2"),
    # Ulysses: the all-to-all to a head split instead of the ring, on the same chunks.
    Case("ulysses_cp2", ["--parallel.cp_degree=2", "--parallel.cp_mode=ulysses"], "ref_b4"),
    Case("ulysses_cp2_compile", ["--parallel.cp_degree=2", "--parallel.cp_mode=ulysses", "--compile.enable=true"],
         "ref_b4"),
    Case("qwen3_ulysses_cp2", ["--parallel.cp_degree=2", "--parallel.cp_mode=ulysses"], "ref_b4", "qwen3"),
    # GLM-4.5: partial RoPE at each chunk's true positions, the score bias moved from the load over the cp ranks.
    Case("glm4_moe_cp2", ["--parallel.cp_degree=2"], "ref_b4", "glm4_moe"),
]
FOUR_RANKS = [
    Case("cp4", ["--parallel.cp_degree=4"], "ref_b4"),
    # 2 key/value heads over 4 ranks: each repeated for two.
    Case("ulysses_cp4", ["--parallel.cp_degree=4", "--parallel.cp_mode=ulysses"], "ref_b4"),
    # Hybrid: Ulysses within ranks {0, 1} and {2, 3}, the ring between the two groups.
    Case("hybrid_cp4", ["--parallel.cp_degree=4", "--parallel.cp_mode=hybrid"], "ref_b4"),
    Case("fsdp2_cp2", ["--parallel.cp_degree=2"], "ref_b8"),
    Case("hsdp2_cp2", ["--parallel.cp_degree=2", "--parallel.dp_replicate=2"], "ref_b8"),
    Case("qwen3_fsdp2_cp2", ["--parallel.cp_degree=2"], "ref_b8", "qwen3"),
    # cp 2 x tp 2: the tp ranks split the heads and, sequence-parallel, each cp rank's chunks.
    Case("cp2_tp2", ["--parallel.cp_degree=2", "--parallel.tp_degree=2"], "ref_b4"),
    Case("qwen3_ulysses_cp2_tp2", ["--parallel.cp_degree=2", "--parallel.tp_degree=2", "--parallel.cp_mode=ulysses"],
         "ref_b4", "qwen3"),
    # cp 2 x pp 2: the stages pass each cp rank's chunks on; the last weights each microbatch's loss by its share.
    Case("cp2_pp2", ["--parallel.cp_degree=2", "--parallel.pp_degree=2"], "ref_b4"),
    Case("qwen3_ulysses_cp2_pp2_interleaved", ["--parallel.cp_degree=2", "--parallel.pp_degree=2",
                                               "--parallel.pp_schedule=Interleaved1F1B", "--parallel.cp_mode=ulysses"],
         "ref_b4", "qwen3_untied"),
]
CASES = {case.name: case for case in TWO_RANKS + FOUR_RANKS}
# With -m slow: Qwen3's Ulysses cp 2 x interleaved pp 2 composes what cp2_pp2 (cp under a pipeline),
# qwen3_ulysses_cp2 (Qwen3's q/k norms through Ulysses) and test_loss_parity.py's pp_interleaved_1f1b and
# qwen3_pp_1f1b (the interleaved schedule, Qwen3's untied output across stages) each show in the default run.
# Likewise each of these composes what two default cases show: op-level selective checkpointing under cp
# (cp2_ac_full: recomputation under cp; test_loss_parity.py's fsdp_ac_selective_ops: the op-level policy), Ulysses
# compiled (cp2_compile: the cp seam compiled; ulysses_cp2: Ulysses eager), Qwen2 under cp (qwen3_cp2: a Qwen family
# through the ring; test_loss_parity.py's qwen2_fsdp2_tp2: Qwen2's biases) and Qwen3 at fsdp 2 x cp 2 (fsdp2_cp2
# and qwen3_cp2).
# Qwen3's Ulysses cp 2 x tp 2 (4 ranks) composes cp2_tp2 (the tp ranks splitting each cp rank's chunks) and
# qwen3_ulysses_cp2 (Qwen3's q/k norms through Ulysses). GLM-4.5's ring cp 2 (its attention's positions are the
# decoder's, which cp2 runs).
SLOW_CASES = ("qwen3_ulysses_cp2_pp2_interleaved", "cp2_ac_selective_ops", "ulysses_cp2_compile", "qwen2_cp2",
              "qwen3_fsdp2_cp2", "qwen3_ulysses_cp2_tp2", "glm4_moe_cp2")

RESUME_BASE = ["--parallel.cp_degree=2", "--lr_scheduler.decay_type=constant"]

# The command docs/long_context.md gives, `torchrun --nproc_per_node 2 train.py --config configs/<config>.toml
# --training.seq_len 2048 --model.max_seq_len 2048 --parallel.cp_degree 2`, on the dense and the MoE debug configs,
# ring and Ulysses: the model shrunk to 2 layers of width 64, 3 steps of 2 sequences (the corpus that ships).
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMMAND = ["--training.seq_len", "2048", "--model.max_seq_len", "2048"]
NO_AUX = ["--model.router_aux_loss_coef=0"]
SHRUNK = ["--model.dim=64", "--model.n_layers=2", "--training.batch_size=2", "--training.max_steps=3",
          "--training.deterministic=true", "--checkpoint.enable=false", "--metrics.log_interval=1",
          "--metrics.tensorboard=false", "--metrics.report=false", "--metrics.progress=lines",
          "--metrics.peak_tflops=1"]
# name -> (config, ranks, overrides beyond the command's, the one-process run it must match).
COMMAND_RUNS = {f"{config}_seq2048_{mode}": (config, 2, ["--parallel.cp_mode", mode], f"{config}_seq2048_one")
                for config in ("debug", "debug_moe") for mode in ("ring", "ulysses")}
# Expert parallelism over the FSDP ranks dp_shard x cp: all of them (ep 2 at cp 2), and ep 2 of dp_shard 2 x cp 2
# (the experts sharded by FSDP over the other 2; the aux loss off: it pools per data-parallel rank, docs/moe.md).
COMMAND_RUNS["debug_moe_seq2048_ep2"] = ("debug_moe", 2, ["--parallel.ep_degree=2"], "debug_moe_seq2048_one")
COMMAND_RUNS["debug_moe_seq2048_fsdp2_ep2"] = ("debug_moe", 4, ["--parallel.ep_degree=2", *NO_AUX],
                                               "debug_moe_seq2048_b4_no_aux")
# With -m slow: ep 2 of dp_shard 2 x cp 2 composes debug_moe_seq2048_ep2 (ep over the cp ranks, in the default run)
# and the expert FSDP over the other ranks that tests/trainer/test_moe_training.py's ep-x-hsdp and resume to ep 2 x
# FSDP 2 show in the default run.
SLOW_COMMANDS = ("debug_moe_seq2048_fsdp2_ep2",)


def command_run(workdir: Path, config: str, name: str, *extra: str):
    """The command on configs/<config>.toml, shrunk, logging to workdir/name."""
    return config_run(CONFIGS / f"{config}.toml", [*COMMAND, *SHRUNK, f"--metrics.log_dir={workdir / name}", *extra])


def command_runs(workdir: Path, ranks: int, names: list[str]) -> list:
    """The command under cp 2 on `ranks` ranks, each config and mode of `names`."""
    return [command_run(workdir, config, name, "--parallel.cp_degree", "2", *extra)
            for name, (config, world, extra, _) in COMMAND_RUNS.items() if world == ranks and name in names]


# The one-process runs the command runs must match: each config at the same global batch.
COMMAND_REFERENCES = {"debug_seq2048_one": ("debug", []), "debug_moe_seq2048_one": ("debug_moe", []),
                      "debug_moe_seq2048_b4_no_aux": ("debug_moe", ["--training.batch_size=4", *NO_AUX])}


def command_references(workdir: Path, names: list[str]) -> list:
    """The one-process runs the command runs `names` compare with."""
    wanted = {COMMAND_RUNS[name][3] for name in names}
    return [command_run(workdir, config, name, *extra) for name, (config, extra) in COMMAND_REFERENCES.items()
            if name in wanted]


def _checkpointing(workdir: Path, name: str) -> list[str]:
    return [f"--checkpoint.dir={workdir / name}", "--checkpoint.enable=true", "--checkpoint.async_save=false"]


FIRST_HALF = ["--training.max_steps=5", "--checkpoint.save_interval=5"]
CONSTANT_LR = ["--lr_scheduler.decay_type=constant"]


def resume_runs(workdir: Path) -> list[list[str]]:
    """Under cp 2: 10 steps straight, and 5 steps saved then resumed to 10; the first 5 steps again, saved for a
    resume in one process and for one at cp 4; and 5 to 10 resumed from one process's checkpoint."""
    return [
        tiny_run(workdir, "cp_straight") + RESUME_BASE,
        tiny_run(workdir, "cp_first_half") + RESUME_BASE + _checkpointing(workdir, "cp_ckpt") + FIRST_HALF,
        tiny_run(workdir, "cp_resumed") + RESUME_BASE + _checkpointing(workdir, "cp_ckpt"),
        tiny_run(workdir, "cp_first_half_for_one") + RESUME_BASE + _checkpointing(workdir, "cp_ckpt_one") + FIRST_HALF,
        tiny_run(workdir, "cp_first_half_for_cp4") + RESUME_BASE + _checkpointing(workdir, "cp_ckpt_cp4") + FIRST_HALF,
        tiny_run(workdir, "cp2_resumed_from_one") + RESUME_BASE + _checkpointing(workdir, "one_ckpt_cp2"),
    ]


def one_process_first_half(workdir: Path) -> list[str]:
    """5 steps in one process, saved for a resume at cp 2."""
    return tiny_run(workdir, "one_first_half") + CONSTANT_LR + _checkpointing(workdir, "one_ckpt_cp2") + FIRST_HALF


def resumed_at_cp4(workdir: Path) -> list[str]:
    """The cp 2 checkpoint of step 5 resumed to step 10 at cp 4."""
    return (tiny_run(workdir, "cp4_resumed_from_cp2") + ["--parallel.cp_degree=4"] + CONSTANT_LR
            + _checkpointing(workdir, "cp_ckpt_cp4"))


def resumed_in_one_process(workdir: Path) -> list[str]:
    """The cp 2 checkpoint of step 5 resumed to step 10 without context parallelism."""
    return tiny_run(workdir, "cp_resumed_in_one") + CONSTANT_LR + _checkpointing(workdir, "cp_ckpt_one")


@pytest.fixture(scope="module")
def cp_runs(request, parallel_workspace: Path) -> Path:
    """The selected cases trained for 10 steps, the documented command's selected runs, and the resume runs: one
    process's (a checkpoint for cp 2 to resume, in this process), a 2-rank and a 4-rank pool, then one process's
    again, each run after the ones whose checkpoints it resumes."""
    cases = {name for test in ("test_context_parallel_losses_match_single_process",
                               "test_context_parallel_starts_from_the_single_process_weights")
             for name in selected_ids(request, test)}
    commands = selected_ids(request, "test_the_documented_command_gives_the_losses_of_one_process")
    work = parallel_workspace
    run_here([one_process_first_half(work)])
    run_pool(2, [tiny_run(work, c.name, model=c.model) + c.overrides for c in TWO_RANKS if c.name in cases]
             + resume_runs(work) + command_runs(work, 2, commands))
    run_pool(4, [tiny_run(work, c.name, model=c.model) + c.overrides for c in FOUR_RANKS if c.name in cases]
             + [resumed_at_cp4(work)] + command_runs(work, 4, commands))
    run_here([resumed_in_one_process(work), tiny_run(work, "ref_b4_validation") + VALIDATION]
             + command_references(work, commands))
    return work


@pytest.mark.parametrize("name", marked_slow(CASES, SLOW_CASES))
def test_context_parallel_losses_match_single_process(cp_runs, name):
    case = CASES[name]
    got, want = losses(cp_runs, name), losses(cp_runs, case.reference_run)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {case.reference_run}:\n{got}\n{want}"
    norms, want_norms = losses(cp_runs, name, "grad_norm"), losses(cp_runs, case.reference_run, "grad_norm")
    assert norms == pytest.approx(want_norms, rel=GRAD_NORM_RTOL), f"{name} grad_norm:\n{norms}\n{want_norms}"


@pytest.mark.parametrize("name", marked_slow(CASES, SLOW_CASES))
def test_context_parallel_starts_from_the_single_process_weights(cp_runs, name):
    (want,) = initial_weights(cp_runs, CASES[name].reference_run)
    held = [set(got) for got in initial_weights(cp_runs, name)]
    assert set().union(*held) == set(want), f"{name}: the ranks hold other parameters than one process"
    for rank, got in enumerate(initial_weights(cp_runs, name)):
        assert set(got) <= set(want), f"{name} rank {rank}"  # a pipeline rank holds its stages' parameters
        for key, value in got.items():
            assert torch.equal(value, want[key]), f"{name} rank {rank}: {key} differs from one process's"


def test_context_parallel_run_resumes_bit_for_bit_from_its_checkpoint(cp_runs):
    straight = losses_by_step(cp_runs, "cp_straight")
    first, resumed = losses_by_step(cp_runs, "cp_first_half"), losses_by_step(cp_runs, "cp_resumed")
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [6, 7, 8, 9, 10]
    assert {**first, **resumed} == straight  # the same layout: the same floats


@pytest.mark.parametrize("resumed", ["cp_resumed_in_one", "cp4_resumed_from_cp2", "cp2_resumed_from_one"])
def test_a_checkpoint_resumes_exactly_under_another_cp_degree(cp_runs, resumed):
    # cp 2 -> one process, cp 2 -> cp 4, one process -> cp 2: the FSDP shards (over dp_shard x cp) resharded, and the
    # loader position, which is per data-parallel rank and so shared by the cp ranks (one data-parallel rank here).
    straight, got = losses_by_step(cp_runs, "cp_straight"), losses_by_step(cp_runs, resumed)
    assert sorted(got) == [6, 7, 8, 9, 10]
    assert got == pytest.approx({step: straight[step] for step in got}, rel=RTOL)


@pytest.mark.parametrize("name", marked_slow(COMMAND_RUNS, SLOW_COMMANDS))
def test_the_documented_command_gives_the_losses_of_one_process(cp_runs, name):
    # MoE: the load-balancing loss pools the expert counts over the cp ranks, so it is the whole sequences' too.
    config, _, extra, reference = COMMAND_RUNS[name]
    pooled = config == "debug_moe" and NO_AUX[0] not in extra
    for key in ("loss", "grad_norm") + (("aux_loss",) if pooled else ()):
        got, want = losses(cp_runs, name, key), losses(cp_runs, reference, key)
        assert len(got) == len(want) == 3, f"{name}: logged {len(got)} steps, one process {len(want)}"
        assert got == pytest.approx(want, rel=RTOL), f"{name} {key}:\n{got}\n{want}"


def _validation_losses(workdir: Path, name: str) -> dict[int, float]:
    lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["val_loss"] for r in map(json.loads, filter(str.strip, lines)) if "val_loss" in r}


def test_context_parallel_validation_loss_matches_single_process(cp_runs):
    got, want = _validation_losses(cp_runs, "cp2_validation"), _validation_losses(cp_runs, "ref_b4_validation")
    assert sorted(want) == [5, 10]
    assert got == pytest.approx(want, rel=RTOL)

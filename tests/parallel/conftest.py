"""Session fixtures of the parallelism tests: the workspace (tokens, single-process references) and the layouts'
runs, each pool of ranks launched once for all the layouts it runs."""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path

import pytest

from .harness import (
    BATCH,
    Case,
    reference_name,
    run_here,
    run_pool,
    run_pools,
    selected_ids,
    tiny_run,
    write_seed_checkpoint,
    write_tokens,
)

# The single-process reference batches: batch_size x dp sequences per step is exactly what dp ranks read together
# (the loader gives rank r the r-th batch_size slice of each global batch).
BATCHES = {"ref_b4": BATCH, "ref_b8": 2 * BATCH, "ref_b16": 4 * BATCH}

TWO_RANKS = [
    Case("fsdp", [], "ref_b8"),
    Case("dp_replicated", ["--parallel.fsdp=false"], "ref_b8"),
    Case("tp", ["--parallel.tp_degree=2"], "ref_b4"),
    Case("pp_gpipe", ["--parallel.pp_degree=2", "--parallel.pp_schedule=GPipe"], "ref_b4"),
    Case("pp_1f1b", ["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"], "ref_b4"),
    Case("pp_interleaved_1f1b", ["--parallel.pp_degree=2", "--parallel.pp_schedule=Interleaved1F1B"], "ref_b4"),
    # Gradient accumulation under PP: two loader batches of 2 become the 4 microbatches of one step.
    Case("pp_1f1b_grad_accum", ["--parallel.pp_degree=2", "--training.batch_size=2",
                                "--training.gradient_accumulation_steps=2"], "ref_b4"),
    Case("fsdp_ac_full", ["--activation_checkpoint.mode=full"], "ref_b8"),
    Case("fsdp_ac_selective", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_every=2"],
         "ref_b8"),
    Case("fsdp_ac_selective_ops", ["--activation_checkpoint.mode=selective",
                                   "--activation_checkpoint.selective_ops=true"], "ref_b8"),
    Case("fsdp_cpu_offload", ["--parallel.cpu_offload=true"], "ref_b8"),
    Case("fsdp_compile", ["--compile.enable=true"], "ref_b8"),
]

FOUR_RANKS = [
    Case("fsdp2_tp2", ["--parallel.tp_degree=2"], "ref_b8"),
    Case("fsdp2_pp2", ["--parallel.pp_degree=2"], "ref_b8"),
    Case("hsdp2x2", ["--parallel.dp_replicate=2"], "ref_b16"),
    Case("tp2_pp2", ["--parallel.tp_degree=2", "--parallel.pp_degree=2"], "ref_b4"),
]


def qwen3(case: Case) -> Case:
    """The Qwen3 run of a Llama layout: tied, untied under pipeline parallelism (which refuses a tied output)."""
    model = "qwen3_untied" if any(o.startswith("--parallel.pp_degree") for o in case.overrides) else "qwen3"
    return Case(f"qwen3_{case.name}", case.overrides, case.reference, model)


def qwen2(case: Case) -> Case:
    """The Qwen2 run of a Llama layout (tied: no pipeline layouts)."""
    return Case(f"qwen2_{case.name}", case.overrides, case.reference, "qwen2")


# Qwen3 in the layouts its differences from Llama meet (the tied output under FSDP and TP, the head-sharded q/k norms
# under TP and compile, op-level selective checkpointing of the norms, the untied output across pipeline stages),
# Qwen2 (q/k/v biases sharded with their columns) under FSDP, TP and FSDP x TP; run in the same pools as Llama's.
# Qwen3 in the remaining, model-independent layouts: test_loss_parity_qwen3_all.py (-m slow).
QWEN3_LAYOUTS = ("fsdp", "tp", "fsdp_compile", "fsdp_ac_selective_ops", "pp_1f1b", "fsdp2_tp2", "tp2_pp2")
QWEN2_LAYOUTS = ("fsdp", "tp", "fsdp2_tp2")
LLAMA_TWO_RANKS, LLAMA_FOUR_RANKS = list(TWO_RANKS), list(FOUR_RANKS)
TWO_RANKS += ([qwen3(case) for case in LLAMA_TWO_RANKS if case.name in QWEN3_LAYOUTS]
              + [qwen2(case) for case in LLAMA_TWO_RANKS if case.name in QWEN2_LAYOUTS])
FOUR_RANKS += ([qwen3(case) for case in LLAMA_FOUR_RANKS if case.name in QWEN3_LAYOUTS]
               + [qwen2(case) for case in LLAMA_FOUR_RANKS if case.name in QWEN2_LAYOUTS])

# gpt-oss (sinks, sliding windows, biased experts) under FSDP 2, with its experts split over the 2 ranks too, and
# under TP 2 (the sinks split by head, the experts' down-projection bias added in halves) and in two pipeline stages.
TWO_RANKS += [Case("gpt_oss_fsdp", [], "ref_b8", "gpt_oss"),
              Case("gpt_oss_fsdp_ep2", ["--parallel.ep_degree=2"], "ref_b8", "gpt_oss"),
              Case("gpt_oss_tp", ["--parallel.tp_degree=2"], "ref_b4", "gpt_oss"),
              Case("gpt_oss_pp_1f1b", ["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"], "ref_b4", "gpt_oss")]

# Qwen3-Next (linear-attention layers, the gated shared expert) under FSDP 2 with its experts split over the 2 ranks
# and under TP 2 (the linear layers split by head, the shared gate replicated), the dense Qwen3.5 under FSDP 2 and
# TP 2 (context parallelism is refused for the family).
TWO_RANKS += [Case("qwen3_next_fsdp_ep2", ["--parallel.ep_degree=2"], "ref_b8", "qwen3_next"),
              Case("qwen3_next_tp", ["--parallel.tp_degree=2"], "ref_b4", "qwen3_next"),
              Case("qwen3_5_fsdp", [], "ref_b8", "qwen3_5"),
              Case("qwen3_5_tp", ["--parallel.tp_degree=2"], "ref_b4", "qwen3_5")]

# GLM-4.5 (partial RoPE, the score-correction bias moved from the load summed over the ranks) under FSDP 2 with its
# experts split over the 2 ranks, under TP 2 (the partly rotated heads split) and in two pipeline stages.
TWO_RANKS += [Case("glm4_moe_fsdp_ep2", ["--parallel.ep_degree=2"], "ref_b8", "glm4_moe"),
              Case("glm4_moe_tp", ["--parallel.tp_degree=2"], "ref_b4", "glm4_moe"),
              Case("glm4_moe_pp_1f1b", ["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"], "ref_b4", "glm4_moe")]
# DeepSeek-V3.2 under FSDP 2, in the sparse stage and in the dense warm-up (each indexer its own FSDP unit: its
# backward is outside its block's; the warm-up's gradient norm is the indexers' alone).
TWO_RANKS += [Case("deepseek_v32_fsdp", [], "ref_b8", "deepseek_v32"),
              Case("deepseek_v32_warmup_fsdp", [], "ref_b8", "deepseek_v32_warmup")]

CASES = {case.name: case for case in TWO_RANKS + FOUR_RANKS}
# With -m slow: Qwen2 under FSDP alone and TP alone; qwen2_fsdp2_tp2 (its biases FSDP-sharded after their TP cut)
# stays in the default run, with test_tp_gradients.py's qwen2_tp2 (the biases' TP gradients). Qwen3 under FSDP alone
# (qwen3_fsdp_ac_selective_ops, qwen3_fsdp_compile and qwen3_fsdp2_tp2 run it with more on top), and GPipe (torch's
# schedule on the same stages that pp_1f1b and pp_interleaved_1f1b run). gpt-oss under FSDP alone (gpt_oss_fsdp_ep2
# runs FSDP 2 with expert parallelism on top) and in two pipeline stages (the stage split is the MoE decoder's, which
# Qwen3-MoE's pipeline layouts run by default).
# Qwen3 at tp 2 x pp 2 (4 ranks, the slowest default case) composes tp2_pp2 (TP inside pipeline stages), qwen3_tp (its
# head-sharded q/k norms under TP) and qwen3_pp_1f1b (its untied output across stages). Qwen3.5 dense under FSDP and
# under TP (its token mixers are Qwen3-Next's, which the default run splits both ways). GLM-4.5 in two pipeline stages
# (the MoE decoder's split, which Qwen3-MoE's pipeline layouts run by default).
SLOW_CASES = ("qwen2_fsdp", "qwen2_tp", "qwen3_fsdp", "pp_gpipe", "gpt_oss_fsdp", "gpt_oss_pp_1f1b", "qwen3_tp2_pp2",
              "qwen3_5_fsdp", "qwen3_5_tp", "glm4_moe_pp_1f1b")

# float8 in torchao's emulation (docs/float8.md), FSDP 2 x TP 2 against one process in float8: tensorwise (the weights
# all-gathered in float8 with their scales precomputed after each step, torchao's float8 TP styles) and rowwise
# (the plain TP styles). Only where torchao is installed (the dev extra).
FLOAT8 = ["--float8.enable=true", "--float8.emulate=true", "--float8.auto_filter_small_kn=false"]
FLOAT8_RECIPES = {"float8": FLOAT8, "float8_rowwise": [*FLOAT8, "--float8.recipe=rowwise"]}
FLOAT8_CASES = {f"{name}_fsdp2_tp2": Case(f"{name}_fsdp2_tp2", ["--parallel.tp_degree=2", *flags], f"{name}_ref_b8")
                for name, flags in FLOAT8_RECIPES.items()} if importlib.util.find_spec("torchao") else {}
# gpt-oss with its experts' grouped GEMMs in float8 too (float8.moe_experts, torchao's MXFP8 emulation) under FSDP 2
# with the experts split over the 2 ranks (ep 2), against one process in float8 (run, as its reference, only when
# selected): in the 2-rank pool.
FLOAT8_MOE = [*FLOAT8, "--float8.moe_experts=true", "--float8.moe_recipe=mxfp8"]
FLOAT8_MOE_CASES = {"gpt_oss_float8_moe_fsdp_ep2": Case("gpt_oss_float8_moe_fsdp_ep2",
                                                        ["--parallel.ep_degree=2", *FLOAT8_MOE], "float8_moe_ref_b8",
                                                        "gpt_oss")} if importlib.util.find_spec("torchao") else {}

# (model, reference batch) of the single-process runs that tests compare with besides CASES' own: the seed
# checkpoints' (ref_b4), the 2-node run's and the 3-D layouts' (ref_b8).
OTHER_REFERENCES = {("llama3", "ref_b4"), ("qwen3", "ref_b4"), ("llama3", "ref_b8"), ("qwen3_untied", "ref_b8")}
# run name -> (batch size, model) of every single-process reference.
REFERENCES = {reference_name(model, batch): (BATCHES[batch], model) for model, batch in
              sorted({(case.model, case.reference) for case in CASES.values()} | OTHER_REFERENCES)}

# Checkpoint and resume under the interleaved schedule (two stages, so two optimizers, per rank): 10 steps straight,
# and 5 steps saved then resumed to 10, with a constant lr so both halves follow the same schedule.
RESUME_BASE = ["--parallel.pp_degree=2", "--parallel.pp_schedule=Interleaved1F1B",
               "--lr_scheduler.decay_type=constant"]

# Models whose seed checkpoint (`titan-npu init-weights` in one process) starts a tensor-parallel run: Qwen3's tied
# output must come out of it as the embedding's one matrix.
SEED_CHECKPOINTS = ("llama3", "qwen3")


def resume_runs(workdir: Path) -> list[list[str]]:
    """The straight run, the first half (saving at step 5) and the resumed second half, in that order."""
    ckpt = [f"--checkpoint.dir={workdir / 'pp_ckpt'}", "--checkpoint.enable=true", "--checkpoint.async_save=false"]
    return [
        tiny_run(workdir, "pp_straight") + RESUME_BASE,
        tiny_run(workdir, "pp_first_half") + RESUME_BASE + ckpt + ["--training.max_steps=5",
                                                                   "--checkpoint.save_interval=5"],
        tiny_run(workdir, "pp_resumed") + RESUME_BASE + ckpt,
    ]


def seed_checkpoint_run(workdir: Path, model: str = "llama3") -> list[str]:
    """Tensor parallel 2 from the seed checkpoint of `model` that one process wrote (compared with its ref_b4)."""
    name = reference_name(model, "tp_from_seed_checkpoint")
    return tiny_run(workdir, name, model=model) + [
        "--parallel.tp_degree=2", f"--checkpoint.initial_load={workdir / reference_name(model, 'seed_ckpt')}"]


@pytest.fixture(scope="session")
def parallel_workspace(tmp_path_factory) -> Path:
    """A token file, a seed checkpoint (`titan-npu init-weights`) and the single-process reference runs (in this
    process, one after another)."""
    workdir = tmp_path_factory.mktemp("parallel")
    write_tokens(workdir / "tokens.jsonl")
    run_here([*[partial(write_seed_checkpoint, workdir, model, reference_name(model, "seed_ckpt"))
                   for model in SEED_CHECKPOINTS],
                 *[tiny_run(workdir, name, batch, model) for name, (batch, model) in REFERENCES.items()]])
    return workdir


@pytest.fixture(scope="session")
def layout_runs(request, parallel_workspace: Path) -> Path:
    """Every selected layout of CASES trained for 10 steps (and the resume runs, and a run from the seed
    checkpoint): one 2-rank pool and one 4-rank pool."""
    selected = {name for test in ("test_layout_losses_match_single_process",
                                  "test_layout_starts_from_the_single_process_weights",
                                  "test_float8_layout_follows_one_float8_process")
                for name in selected_ids(request, test)}
    # The float8 layouts' one-process references (float8 too), only for the layouts selected.
    float8_dense = [case for case in FLOAT8_CASES.values() if case.name in selected]
    float8_moe = [case for case in FLOAT8_MOE_CASES.values() if case.name in selected]
    run_here([tiny_run(parallel_workspace, case.reference, 2 * BATCH) + FLOAT8_RECIPES[case.reference[:-len("_ref_b8")]]
              for case in float8_dense]
             + [tiny_run(parallel_workspace, case.reference_run, 2 * BATCH, case.model) + FLOAT8_MOE
                for case in float8_moe])
    two = [tiny_run(parallel_workspace, case.name, model=case.model) + case.overrides
           for case in TWO_RANKS + float8_moe if case.name in selected]
    run_pool(2, two + resume_runs(parallel_workspace)
             + [seed_checkpoint_run(parallel_workspace, model) for model in SEED_CHECKPOINTS])
    run_pools({4: [tiny_run(parallel_workspace, case.name, model=case.model) + case.overrides
                   for case in FOUR_RANKS + list(FLOAT8_CASES.values()) if case.name in selected]})
    return parallel_workspace

"""Tiny training runs for the parallelism tests: a token file, and pools of gloo ranks that run many layouts one
after another in the same processes (one process group per pool). Every run starts from the weights its seed
gives (no seed checkpoint: the initial weights must not depend on the layout) and leaves them, gathered, in its
log dir for comparison."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import spawn_ranks

from titan_npu.config.schema import JobConfig
from titan_npu.parallel.dims import ParallelDims
from titan_npu.parallel.process_group import free_port

STEPS = 10
BATCH = 4  # per data-parallel rank
MODEL = {"name": "llama3", "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
         "max_seq_len": 64}
# The other families at the same size, each with what sets it apart from Llama: Qwen3's per-head q/k norms, a head
# size (32) set apart from dim / n_heads (16) and a tied output (untied for pipeline parallelism, which refuses a
# tied one); Qwen2's q/k/v biases, grouped-query attention 4:1 and a tied output.
_QWEN3 = {**MODEL, "name": "qwen3", "head_dim": 32, "ffn_dim": 192, "tie_embeddings": True}
_HYBRID = {**MODEL, "head_dim": 16, "full_attention_interval": 2, "linear_n_k_heads": 2, "linear_n_v_heads": 4,
           "linear_k_head_dim": 16, "linear_v_head_dim": 16}
_DSA = {"name": "deepseek_v32", "flavor": "debug", "dim": 64, "n_layers": 2, "vocab_size": 512, "max_seq_len": 64,
        "index_topk": 8}
MODELS = {
    "llama3": MODEL,
    "qwen3": _QWEN3,
    "qwen3_untied": {**_QWEN3, "tie_embeddings": False},
    "qwen2": {**MODEL, "name": "qwen2", "n_heads": 8, "ffn_dim": 192, "tie_embeddings": True},
    # gpt-oss: attention sinks, a window of 8 of the 32 positions on alternate layers, YaRN, 4 biased experts top-2.
    "gpt_oss": {**MODEL, "name": "gpt_oss", "head_dim": 16, "n_experts": 4, "top_k": 2, "moe_ffn_dim": 64,
                "sliding_window": 8, "yarn_original_seq_len": 16},
    # Qwen3-Next: gated DeltaNet and gated attention layers alternating, 4 experts top-2 with a gated shared expert;
    # Qwen3.5 dense: the same mixers, SwiGLU feed-forwards.
    "qwen3_next": {**_HYBRID, "name": "qwen3_next", "n_experts": 4, "top_k": 2, "moe_ffn_dim": 64,
                   "shared_ffn_dim": 32},
    "qwen3_5": {**_HYBRID, "name": "qwen3_5", "flavor": "debug-dense", "ffn_dim": 128},
    # GLM-4.5: q/k/v biases, q/k norms, a quarter of each head rotated, the first layer dense, 4 experts in 2 groups
    # (top-2 from the best one) by sigmoid scores with the score-correction bias moving each step, one shared expert.
    "glm4_moe": {**MODEL, "name": "glm4_moe", "flavor": "debug", "head_dim": 16, "ffn_dim": 128,
                 "partial_rotary_factor": 0.25, "n_experts": 4, "top_k": 2, "moe_ffn_dim": 64, "n_groups": 2,
                 "topk_groups": 1, "score_bias_rate": 0.01},
    # DeepSeek-V3.2 (models/deepseek_v32's debug shapes at dim 64, 2 layers): each query keeps 8 of up to 32 keys,
    # its indexers learning by their KL loss; and the dense warm-up, where they alone train.
    "deepseek_v32": _DSA,
    "deepseek_v32_warmup": {**_DSA, "dsa_stage": "dense_warmup"},
}


# What a pool runs: a training run's overrides, or a function (picklable) called in every process of the pool.
Job = list[str] | Callable[[], None]


@dataclass
class Case:
    """One training run: its name, its overrides on top of the tiny run of `model` (a key of MODELS), and the
    reference batch it must match."""

    name: str
    overrides: list[str] = field(default_factory=list)
    reference: str = "ref_b4"
    model: str = "llama3"

    @property
    def reference_run(self) -> str:
        """The single-process run this one must match: `model` with the reference batch."""
        return reference_name(self.model, self.reference)


def reference_name(model: str, run: str) -> str:
    """The name of run `run` (a reference batch such as ref_b8, a seed checkpoint) of the tiny `model`: Llama's
    keep the bare name."""
    return run if model == "llama3" else f"{model}_{run}"


def write_tokens(path: Path, n_docs: int = 120, seed: int = 0) -> Path:
    """A tokens .jsonl ({"tokens": [...]} per line) of random documents, enough for 10 steps of 16 sequences."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n_docs):
            tokens = rng.integers(0, 256, size=int(rng.integers(40, 160))).tolist()
            f.write(json.dumps({"tokens": tokens}) + "\n")
    return path


def model_overrides(model: str = "llama3") -> list[str]:
    """The [model] overrides of the tiny model `model` (a key of MODELS)."""
    return [f"--model.{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in MODELS[model].items()]


def tiny_run(workdir: Path, name: str, batch_size: int = BATCH, model: str = "llama3") -> list[str]:
    """Overrides of a 10-step fp32 deterministic run of the tiny `model` from training.seed's weights, logging
    every step to workdir/name."""
    args = model_overrides(model)
    args += [
        "--training.seq_len=32", f"--training.batch_size={batch_size}", f"--training.max_steps={STEPS}",
        "--training.dtype=fp32", "--training.deterministic=true", "--training.seed=7",
        "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=3",
        f"--data.path={workdir / 'tokens.jsonl'}", "--data.tokenizer=byte", "--data.num_workers=0",
        "--checkpoint.enable=false",
        f"--metrics.log_dir={workdir / name}", "--metrics.log_interval=1", "--metrics.tensorboard=false",
        "--metrics.report=false", "--metrics.progress=lines",
        # A fixed peak skips measuring the CPU's matmul peak (seconds per process, and MFU is not under test).
        "--metrics.peak_tflops=1",
    ]
    return args


def losses(workdir: Path, name: str, key: str = "loss") -> list[float]:
    """The per-step losses (or another logged number, e.g. grad_norm) of a run, from its metrics.jsonl."""
    return list(losses_by_step(workdir, name, key).values())


def losses_by_step(workdir: Path, name: str, key: str = "loss") -> dict[int, float]:
    """step -> loss (or `key`) of a run, from its metrics.jsonl."""
    lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r[key] for r in records if "loss" in r and "step" in r}


def write_seed_checkpoint(workdir: Path, model: str = "llama3", name: str = "seed_ckpt") -> None:
    """`titan-npu init-weights` with the tiny run of `model`'s config: its seed checkpoint, in workdir/name."""
    from titan_npu.cli import main

    code = main(["init-weights", "--output", str(workdir / name), *tiny_run(workdir, name, model=model)])
    assert code == 0, f"titan-npu init-weights exited {code}"


def initial_weights(workdir: Path, name: str, when: str = "initial") -> list[dict[str, torch.Tensor]]:
    """Per rank, the full (gathered) initial weights of the model parts that rank held in run `name` (when="final":
    the weights after its last step, saved by a final_weights_run)."""
    files = sorted((workdir / name).glob(f"{when}_weights.rank*.pt"))
    return [torch.load(f, weights_only=True) for f in files]


def final_weights(workdir: Path, name: str) -> dict[str, torch.Tensor]:
    """The full weights after the last step of final_weights_run `name`, every rank's parts together."""
    return {key: value for part in initial_weights(workdir, name, "final") for key, value in part.items()}


def _save_weights(trainer, log_dir: Path, when: str = "initial") -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = {}
    for part in trainer.model_parts:
        full.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
    log_dir.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in full.items()}, log_dir / f"{when}_weights.rank{trainer.rank}.pt")


def config_run(config: Path, args: list[str]) -> Job:
    """A pool job: a training run of the config file `config` with the command-line overrides `args`."""
    return partial(_train, args, config)


def final_weights_run(args: list[str], config: Path | None = None) -> Job:
    """A pool job: the training run `args` (on the config file `config`, if any) that also leaves its gathered final
    weights (final_weights reads them)."""
    return partial(_train, args, config, True)


def _train(args: list[str], config: Path | None = None, save_final: bool = False) -> None:
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    cfg = load_config(config, args)
    trainer = Trainer(cfg)
    _save_weights(trainer, Path(cfg.metrics.log_dir))
    trainer.train()
    if save_final:
        _save_weights(trainer, Path(cfg.metrics.log_dir), "final")
    # Not trainer.close(): the process group stays up for the pool's next case.
    trainer.checkpointer.close()
    trainer.metrics.close()


def _worker(rank: int, world: int, port: int, runs: list[Job]) -> None:
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    os.environ["TITAN_DEVICE"] = "cpu"
    torch.set_num_threads(1)  # several ranks share two cores
    try:
        for job in runs:
            job() if callable(job) else _train(job)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_pool(world: int, runs: list[Job]) -> None:
    """Run the jobs one after another in `world` new processes (tests/ranks.py); raises if any rank fails."""
    spawn_ranks(_worker, (world, free_port(), runs), world)


def run_here(runs: list[Job]) -> None:
    """Run the jobs one after another in this process as one CPU rank (one intra-op thread, as a pool's ranks): a
    one-process pool without the launch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                monkeypatch.delenv(name, raising=False)
            monkeypatch.setenv("TITAN_DEVICE", "cpu")
            for job in runs:
                job() if callable(job) else _train(job)
    finally:
        torch.set_num_threads(threads)


def run_pools(pools: dict[int, list[Job]]) -> None:
    """Run each world size's jobs in one pool, smallest world first; a world without jobs launches nothing."""
    for world, runs in sorted(pools.items()):
        if runs:
            run_pool(world, runs)


def marked_slow(names: Iterable[str], slow: Iterable[str]) -> list:
    """`names` as test parameters, those in `slow` marked slow."""
    slow = set(slow)
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]


def selected_ids(request: pytest.FixtureRequest, test: str) -> list[str]:
    """The parameter ids of test function `test` that this session runs (after -m and -k), for a fixture that pools
    exactly the runs those tests read; "" for an unparametrized test."""
    return [item.callspec.id if hasattr(item, "callspec") else "" for item in request.session.items
            if getattr(item, "originalname", None) == test]


def parallel_pair(cfg: JobConfig) -> tuple[torch.nn.Module, torch.nn.Module, ParallelDims]:
    """The model of `cfg` parallelized over this process group's ranks and one process's model from the same seed;
    and the ParallelDims."""
    import torch.distributed as dist

    from titan_npu.models.registry import build_model, build_model_args, spec_of
    from titan_npu.parallel.parallelize import materialize

    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    dims.build_mesh("cpu")
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = build_model(args)
    model = spec_of(model.args).parallelize(model, dims, cfg)
    materialize(model, torch.device("cpu"), cfg)
    reference = build_model(args)
    reference.init_weights(seed=cfg.training.seed)
    return model, reference, dims


def tensor_parallel_pair(cfg: JobConfig) -> tuple[torch.nn.Module, torch.nn.Module, ParallelDims]:
    """parallel_pair for tensor parallelism alone (asserts that tp is the whole world)."""
    model, reference, dims = parallel_pair(cfg)
    assert dims.tp == dims.world_size and not dims.dp_enabled, dims.describe()
    return model, reference, dims


def gradient_problems(where: str, model: torch.nn.Module, reference: torch.nn.Module, rtol: float,
                      atol: float) -> list[str]:
    """Each parameter of the parallelized `model` whose gradient is missing, placed or sharded unlike the parameter,
    or unlike one process's (`reference`'s, same names) beyond rtol/atol."""
    want = dict(reference.named_parameters())
    problems = []
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if p.grad is None:
            problems.append(f"{where} {name}: no gradient")
            continue
        if tuple(p.grad.placements) != tuple(p.placements):
            problems.append(f"{where} {name}: gradient placements {p.grad.placements} != parameter {p.placements}")
        if p.grad.to_local().shape != p.to_local().shape:
            problems.append(f"{where} {name}: local gradient {list(p.grad.to_local().shape)} != shard "
                            f"{list(p.to_local().shape)}")
        full = p.grad.full_tensor()
        if not torch.allclose(full, want[name].grad, rtol=rtol, atol=atol):
            err = (full - want[name].grad).abs().max().item()
            problems.append(f"{where} {name}: gradient differs from one process by up to {err:.3g}")
    return problems


def _write_report(check: Callable[[str], list[str]], cases: list[str], workdir: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    report = {case: check(case) for case in cases}
    (Path(workdir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


def rank_reports(world: int, check: Callable[[str], list[str]], cases: list[str],
                 workdir: Path) -> dict[str, list[str]]:
    """check(case) (picklable: a module-level function) for every case on each of `world` gloo ranks, one pool;
    case -> the problems any rank found, each prefixed with its rank."""
    run_pool(world, [partial(_write_report, check, list(cases), str(workdir))])
    report: dict[str, list[str]] = {case: [] for case in cases}
    for rank in range(world):
        for case, problems in json.loads((workdir / f"rank{rank}.json").read_text()).items():
            report[case] += [f"rank {rank}: {p}" for p in problems]
    return report

"""LoRA trains alike in every layout: under FSDP 2 (adapters sharded with their linears' dim 0), FSDP 2 with full
activation checkpointing, TP 2 (B cut by rows under a column-parallel linear, A by columns under a row-parallel
one) and PP 2 (1F1B; each stage's optimizer takes its own adapters) the per-step losses equal one process's to 1e-5
relative over 10 fp32 steps, and the adapters the last step saves equal its to 1e-5 (absolute); the frozen weights
stay the seed's. All runs in one 2-rank pool; TP 2's adapter gradients are held to one process's too."""

from __future__ import annotations

import pytest
import torch

from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries

from .harness import STEPS, losses, run_here, run_pool, tiny_run

pytestmark = pytest.mark.distributed

RTOL = 1e-5
# On the adapters' values (A of order 0.3): AdamW divides each update by its gradient's own scale, so the reordered
# sums of another layout (1e-7 apart) show in the weights at about lr x 1e-3.
ATOL = 1e-5
LORA = ["--lora.enable=true", "--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=[\"wq\",\"wv\",\"wo\",\"w1\","
        "\"w2\"]"]
# name -> (overrides on the tiny run, the one-process reference it must match). Two ranks split a batch of 8.
CASES = {
    "lora_fsdp": ([], "lora_ref_b8"),
    "lora_fsdp_ac": (["--activation_checkpoint.mode=full"], "lora_ref_b8"),
    "lora_tp": (["--parallel.tp_degree=2"], "lora_ref_b4"),
    "lora_pp": (["--parallel.pp_degree=2", "--parallel.pp_schedule=1F1B"], "lora_ref_b4"),
}
REFERENCES = {"lora_ref_b4": 4, "lora_ref_b8": 8}


def _saving(workdir, name: str) -> list[str]:
    return [f"--checkpoint.dir={workdir / (name + '_ckpt')}", "--checkpoint.enable=true",
            "--checkpoint.async_save=false", f"--checkpoint.save_interval={STEPS}"]


@pytest.fixture(scope="module")
def lora_runs(parallel_workspace):
    """The one-process references here, then every layout in one 2-rank pool; each saves its last step."""
    workdir = parallel_workspace
    run_here([tiny_run(workdir, name, batch) + LORA + _saving(workdir, name) for name, batch in REFERENCES.items()])
    run_pool(2, [tiny_run(workdir, name) + LORA + extra + _saving(workdir, name)
                 for name, (extra, _) in CASES.items()])
    return workdir


def _model(workdir, name: str) -> dict[str, torch.Tensor]:
    path = workdir / f"{name}_ckpt" / f"step-{STEPS}"
    metadata = read_metadata(path)
    return load_tensors(path, metadata, [f"model.{k}" for k in tensor_entries(metadata, "model.")])


@pytest.mark.parametrize("name", list(CASES))
def test_lora_layout_losses_and_adapters_match_single_process(lora_runs, name):
    reference = CASES[name][1]
    got, want = losses(lora_runs, name), losses(lora_runs, reference)
    assert len(want) == STEPS and len(got) == STEPS, f"{name}: logged {len(got)} steps, reference {len(want)}"
    assert got == pytest.approx(want, rel=RTOL), f"{name} vs {reference}:\n{got}\n{want}"
    mine, ref = _model(lora_runs, name), _model(lora_runs, reference)
    assert mine.keys() == ref.keys()
    adapters = [k for k in ref if k.endswith((".lora_A", ".lora_B"))]
    assert len(adapters) == 4 * 5 * 2  # 4 layers x 5 targets x (A, B)
    for key in ref:
        if key in adapters:
            err = (mine[key] - ref[key]).abs().max().item()
            assert torch.allclose(mine[key], ref[key], rtol=RTOL, atol=ATOL), f"{key}: differs by up to {err:.3g}"
        else:  # frozen: the seed's weights, whatever the layout
            assert torch.equal(mine[key], ref[key]), key


def test_lora_starts_as_the_base_model_and_then_trains_its_own_way(lora_runs):
    # Guards the comparison: step 1 is full training's (conftest's ref_b8: the same seed weights and batches, B = 0
    # makes the adapted model the base), later steps differ (only the adapters moved), and every B left zero.
    lora, full = losses(lora_runs, "lora_ref_b8"), losses(lora_runs, "ref_b8")
    assert lora[0] == pytest.approx(full[0], rel=1e-6)
    assert all(abs(a - b) > 1e-4 for a, b in zip(lora[2:], full[2:]))
    ref = _model(lora_runs, "lora_ref_b8")
    assert all(ref[k].abs().max() > 0 for k in ref if k.endswith(".lora_B"))


def _tp_gradient_problems(case: str) -> list[str]:
    """Tensor parallel 2 with adapters whose B is non-zero: the logits and every adapter's gradient (placed as the
    adapter) equal one process's."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from titan_npu.config.loader import load_config
    from titan_npu.lora.apply import lora_adapter
    from titan_npu.models.registry import build_model, build_model_args, spec_of
    from titan_npu.parallel.dims import ParallelDims
    from titan_npu.parallel.parallelize import materialize
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.loss import cross_entropy_loss

    from .harness import model_overrides

    cfg = load_config(None, model_overrides("llama3") + LORA + ["--training.dtype=fp32", "--parallel.tp_degree=2",
                                                                "--parallel.dp_shard=1"])
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    dims.build_mesh("cpu")
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = build_model(args)
    lora_adapter(cfg.lora)(model)
    model = spec_of(args).parallelize(model, dims, cfg)
    materialize(model, torch.device("cpu"), cfg)
    reference = build_model(args)
    lora_adapter(cfg.lora)(reference)
    reference.init_weights(seed=cfg.training.seed)
    generator = torch.Generator().manual_seed(5)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
                params[name].to_local().copy_(distribute_tensor(p, params[name].device_mesh,
                                                                params[name].placements).to_local())
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with loss_parallel_context(dims, cfg.parallel.loss_parallel):
        cross_entropy_loss(model(inputs), labels).backward()
    cross_entropy_loss(reference(inputs), labels).backward()
    want = dict(reference.named_parameters())
    problems = []
    for name, p in model.named_parameters():
        if not name.endswith((".lora_A", ".lora_B")):
            if p.requires_grad or p.grad is not None:
                problems.append(f"{case} {name}: frozen in one process, trained here")
            continue
        if tuple(p.grad.placements) != tuple(p.placements):
            problems.append(f"{case} {name}: gradient placed {p.grad.placements}, the adapter {p.placements}")
        elif not torch.allclose(p.grad.full_tensor(), want[name].grad, rtol=1e-5, atol=1e-6):
            err = (p.grad.full_tensor() - want[name].grad).abs().max().item()
            problems.append(f"{case} {name}: gradient differs from one process by up to {err:.3g}")
    return problems


def test_lora_gradients_under_tensor_parallel_equal_one_process(tmp_path):
    from .harness import rank_reports

    report = rank_reports(2, _tp_gradient_problems, ["lora_tp2"], tmp_path)
    assert not report["lora_tp2"], "\n".join(report["lora_tp2"])

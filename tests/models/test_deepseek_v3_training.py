"""configs/debug_deepseek.toml trains from the command line with a falling loss and resumes bit for bit, its score
bias and multi-token prediction module included; aux-loss-free balancing moves the expert load toward even and only
selects experts (it never enters a gradient); the sequence-wise balance loss is the paper's; multi-token prediction
learns, leaves the main loss alone, is causal and keeps its Hugging Face layer."""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from hf_reference import ROOT, run_python
from torch.overrides import TorchFunctionMode

from titan_npu.checkpoint.formats import read_weights
from titan_npu.config.loader import load_config
from titan_npu.models.moe.group_router import sequence_balance_loss
from titan_npu.models.registry import build_model, build_model_args, get_spec
from titan_npu.trainer import Trainer
from titan_npu.trainer.routing import RoutingMeter, update_score_biases

CONFIG = ROOT / "configs" / "debug_deepseek.toml"
SHORT = ["--training.seq_len", "64", "--training.batch_size", "4", "--lr_scheduler.warmup_steps", "2",
         "--metrics.log_interval", "1", "--metrics.tensorboard", "false", "--metrics.report", "false",
         "--metrics.progress", "lines", "--training.deterministic", "true"]


def _records(log_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_debug_deepseek_trains_from_the_command_line_and_resumes_bit_for_bit(tmp_path, _single_process):
    # The bias moves (rate 0.01), the sequence-wise loss is on and a multi-token prediction module trains, so all
    # are in what the resume must restore.
    argv = [str(ROOT / "train.py"), "--config", str(CONFIG), *SHORT, "--training.max_steps", "4",
            "--model.score_bias_rate", "0.01", "--model.seq_aux_loss_coef", "0.001", "--model.mtp_depth", "1",
            "--checkpoint.dir", str(tmp_path / "ckpt"), "--checkpoint.save_interval", "2",
            "--checkpoint.keep_last_n", "5", "--checkpoint.async_save", "false"]
    whole = run_python(*argv, "--metrics.log_dir", str(tmp_path / "whole"), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    records = _records(tmp_path / "whole")
    assert [r["step"] for r in records] == list(range(1, 5))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert all(len(r["expert_load_per_layer"]) == 4 for r in records)  # layers 1-3 are MoE, then the MTP module
    assert all(r["mtp_loss"] > 0 for r in records)
    final = read_weights(tmp_path / "ckpt" / "step-4").state_dict
    shutil.move(tmp_path / "ckpt" / "step-4", tmp_path / "step-4-whole")
    # Resumed in this process (the same config as the command line's): the rest of the run from step 2's checkpoint.
    cfg = load_config(CONFIG, [*argv[3:], "--metrics.log_dir", str(tmp_path / "resumed")])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    again = _records(tmp_path / "resumed")
    assert [r["step"] for r in again] == [3, 4]
    assert [(r["loss"], r["mtp_loss"]) for r in again] == [(r["loss"], r["mtp_loss"]) for r in records[2:]]
    assert any(k.startswith("layers.4.eh_proj") for k in final)  # the module is layer n_layers, saved with the rest
    back = read_weights(tmp_path / "ckpt" / "step-4").state_dict
    moved = [k for k in final if k.endswith("router.score_bias") and final[k].abs().sum() > 0]
    assert moved == [f"layers.{i}.feed_forward.router.score_bias" for i in (1, 2, 3, 4)]  # the MTP module's too
    for key, tensor in final.items():
        assert torch.equal(back[key], tensor), key


def _as_one_cpu_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_DEVICE", "cpu")


@pytest.fixture
def _single_process(monkeypatch):
    _as_one_cpu_process(monkeypatch)


def _train(tmp_path: Path, *extra: str, steps: int = 12) -> list[dict]:
    cfg = load_config(CONFIG, [*SHORT, "--training.max_steps", str(steps), "--metrics.log_dir", str(tmp_path / "logs"),
                               "--checkpoint.enable", "false", *extra])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return _records(tmp_path / "logs")


def test_the_score_bias_moves_the_expert_load_toward_even(tmp_path, one_thread, _single_process):
    fixed = _train(tmp_path / "fixed", "--model.score_bias_rate", "0")
    balanced = _train(tmp_path / "balanced", "--model.score_bias_rate", "0.01")
    assert fixed[0]["expert_load_max_mean"] == balanced[0]["expert_load_max_mean"]  # the same start
    late = slice(8, 12)

    def mean_load(records):
        return sum(r["expert_load_max_mean"] for r in records[late]) / 4

    # Measured: max / mean tokens per expert 3.77 with the bias fixed, 2.84 with it moving (8 experts, top-2).
    assert mean_load(balanced) < mean_load(fixed) - 0.5


def _debug_model(seed: int = 0) -> torch.nn.Module:
    cfg = load_config(CONFIG, ["--model.dim", "64", "--model.n_layers", "2"])
    model = build_model(build_model_args(cfg.model))
    model.init_weights(seed=seed)
    return model


def test_the_score_bias_only_selects_experts_and_is_moved_outside_the_gradient():
    model = _debug_model()
    assert not any(name.endswith("score_bias") for name, _ in model.named_parameters())
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))

    def grads():
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, before = grads()
    (bias,) = model.score_biases().values()
    with torch.no_grad():
        bias.add_(0.25)  # the same shift for every expert: the same choices, and weights never see the bias
    loss_shifted, after = grads()
    assert torch.equal(loss, loss_shifted) and before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    # The update reads the step's load and leaves every parameter and gradient as it was.
    meter = RoutingMeter(model)
    meter.begin_step()
    meter.add_auxiliary(loss_shifted, 1.0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    old = bias.clone()
    update_score_biases(meter, _one_rank())
    assert not torch.equal(bias, old)
    load = meter.sums["expert_tokens"][0]
    assert torch.allclose(bias - old, model.args.score_bias_rate * torch.sign(load.mean() - load), atol=1e-7)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p.grad, after[n]) for n, p in model.named_parameters() if p.grad is not None)


def _one_rank():
    from titan_npu.parallel import ParallelDims

    return ParallelDims.from_config(load_config(CONFIG).parallel, 1)


def test_weights_initialised_after_the_meta_device_start_with_a_zero_score_bias():
    args = build_model_args(load_config(CONFIG, ["--model.n_layers", "2"]).model)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    for bias in model.score_biases().values():
        bias.fill_(float("nan"))  # whatever memory to_empty handed out
    model.init_weights(seed=1)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in model.score_biases().values())


def test_a_softmax_router_with_a_score_bias_also_starts_at_zero_after_the_meta_device():
    from dataclasses import replace

    args = build_model_args(load_config(ROOT / "configs" / "debug_moe.toml", ["--model.n_layers", "1"]).model)
    moe_args = args.moe_args
    args.moe_args = lambda: replace(moe_args(), score_bias=True)  # the shared Router, with aux-loss-free balancing
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    routers = [m for m in model.modules() if getattr(m, "score_bias", None) is not None]
    assert routers
    for router in routers:
        router.score_bias.fill_(float("nan"))
    model.init_weights(seed=1)
    assert all(torch.equal(r.score_bias, torch.zeros_like(r.score_bias)) for r in routers)


class _HostReads(TorchFunctionMode):
    """The trainer steps at which a device value was read on the host (item, tolist, cpu, ...)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer, self.steps = trainer, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # valid_labels counts the loader's host labels (it refuses a device tensor): no device read.
        if getattr(func, "__name__", "") in {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"} \
                and traceback.extract_stack(limit=2)[0].name != "valid_labels":
            self.steps.add(self.trainer.step)
        return func(*args, **(kwargs or {}))


# The skip on a device flag / decided on the host / by fp16's loss scaler on overflowing gradients (installed on an
# fp32 run: CPUs refuse fp16). Steps 1 and 3 log; the device flag and the scaler's read nothing at step 2.
@pytest.mark.parametrize("implementation, scaler", [("fused", False), ("foreach", False), ("fused", True)],
                         ids=["device-flag", "host", "loss-scaler"])
def test_the_score_bias_stays_on_a_step_whose_update_was_skipped(tmp_path, one_thread, _single_process,
                                                                  implementation, scaler):
    from fault_hooks import Faults

    cfg = load_config(CONFIG, [*SHORT, "--training.max_steps", "3", "--training.seq_len", "32",
                               "--training.batch_size", "2", "--model.dim", "64", "--model.n_layers", "2",
                               "--model.score_bias_rate", "0.01", "--optimizer.implementation", implementation,
                               "--metrics.log_dir", str(tmp_path / "logs"), "--checkpoint.enable", "false",
                               "--metrics.log_interval", "3"])
    trainer = Trainer(cfg)
    if scaler:  # as training.dtype = fp16 builds it: the scaler, not the guard, skips overflowing steps
        trainer.grad_scaler = torch.amp.GradScaler("cpu")
        trainer.reliability.guard.scaler_handles_overflow = True
    Faults(nan_at=2).install(trainer)  # step 2's loss (and gradients) non-finite: its update is skipped
    biases: dict[int, torch.Tensor] = {}
    trainer.step_callbacks.append(lambda step: biases.update({step: torch.cat(
        list(trainer.model.score_biases().values())).clone()}))
    reads = _HostReads(trainer)
    try:
        with reads:
            trainer.train()
    finally:
        trainer.close()
    assert trainer.reliability.guard.total == 1
    assert (2 in reads.steps) == (implementation == "foreach")  # the for-each optimizer's skip is a host decision
    assert not torch.equal(biases[1], torch.zeros_like(biases[1]))
    assert torch.equal(biases[2], biases[1])  # the skipped step moved no bias
    assert not torch.equal(biases[3], biases[2])


def test_the_sequence_balance_loss_is_one_when_even_and_grows_with_concentration():
    n_experts, tokens = 4, 8  # top-2
    even_scores = torch.full((tokens, n_experts), 0.5)
    even = torch.tensor([[0, 1], [2, 3]] * (tokens // 2))
    assert sequence_balance_loss(even, even_scores, 1).item() == pytest.approx(1.0)
    skewed_scores = torch.tensor([[0.9, 0.9, 0.1, 0.1]]).expand(tokens, -1)
    skewed = torch.tensor([[0, 1]] * tokens)
    # f = (2, 2, 0, 0), P = (0.45, 0.45, 0.05, 0.05): 1.8.
    assert sequence_balance_loss(skewed, skewed_scores, 1).item() == pytest.approx(1.8)
    # Two sequences are scored apart and averaged, not pooled.
    both = sequence_balance_loss(torch.cat([even, skewed]), torch.cat([even_scores, skewed_scores]), 2)
    assert both.item() == pytest.approx(1.4)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.tp_degree", "2", "--model.seq_aux_loss_coef", "0.001"], "the sequence-wise balance loss under"),
    (["--parallel.cp_degree", "2", "--model.mtp_depth", "1"], "multi-token prediction shifts whole sequences"),
    (["--parallel.pp_degree", "2", "--model.seq_aux_loss_coef", "0.001"],
     "the sequence-wise balance loss across pipeline stages"),
], ids=["tp-with-seq-aux", "cp-with-mtp", "pp-with-seq-aux"])
def test_layouts_deepseek_does_not_take_yet_are_refused_in_one_line(overrides, message):
    from titan_npu.errors import LayoutError
    from titan_npu.parallel import ParallelDims

    cfg = load_config(CONFIG, ["--parallel.dp_shard", "1", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, 2)
    spec, args = get_spec("deepseek_v3"), build_model_args(cfg.model)
    with torch.device("meta"):
        model = spec.build_model(args)
    with pytest.raises(LayoutError, match=message) as error:
        spec.parallelize(model, dims, cfg)
    assert "\n" not in str(error.value)


def test_multi_token_prediction_learns_and_is_logged_beside_the_loss(tmp_path, one_thread, _single_process):
    records = _train(tmp_path, "--model.mtp_depth", "1", steps=8)
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"] - 1.0
    assert records[-1]["loss"] < records[0]["loss"] - 1.0


def _mtp_model(depth: int) -> torch.nn.Module:
    cfg = load_config(CONFIG, ["--model.dim", "64", "--model.n_layers", "2", "--model.mtp_depth", str(depth)])
    model = build_model(build_model_args(cfg.model))
    model.init_weights(seed=0)
    return model


def test_multi_token_prediction_leaves_the_main_loss_alone_and_sees_no_later_token():
    with_mtp, without = _mtp_model(2), _mtp_model(0)
    assert sum(p.numel() for p in with_mtp.parameters()) == with_mtp.args.num_params()
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if k in without.state_dict()})
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        assert torch.equal(with_mtp(inputs, labels, 64), without(inputs, labels, 64))
        assert len(with_mtp.mtp_losses) == 2 and without.auxiliary_loss() is None
        coef = with_mtp.args.mtp_loss_coef
        assert torch.allclose(with_mtp.auxiliary_loss(), coef * (with_mtp.mtp_losses[0] + with_mtp.mtp_losses[1]) / 2)

        def depth_one_logits(labels):
            """Module 1's logits: it predicts token i + 2 at position i."""
            h = with_mtp.run_layers(with_mtp.tok_embeddings(inputs))
            block = with_mtp.layers[str(with_mtp.args.n_layers)]
            _, normed, _ = block(h[:, :-1], with_mtp.tok_embeddings(labels[:, :-1]), with_mtp.freqs_cos,
                              with_mtp.freqs_sin)
            return with_mtp.output(normed)

        changed = labels.clone()
        changed[:, 20] = (changed[:, 20] + 1) % 512  # token 21
        before, after = depth_one_logits(labels), depth_one_logits(changed)
    # Positions up to 19 see tokens up to 21 only through labels[:, :20]: unchanged; position 20 sees it. Unchanged
    # up to rounding: the changed token reroutes its own rows, and a multi-threaded CPU GEMM may round another row
    # of a resized expert group differently (bit-equal with one thread); a token it sees moves logits by O(1).
    assert (before[:, :20] - after[:, :20]).abs().max() < 1e-5
    assert (before[:, 20] - after[:, 20]).abs().max() > 1e-2


def test_the_hf_multi_token_prediction_layer_is_kept_with_mtp_depth_and_set_aside_without(caplog):
    model = _mtp_model(1)
    spec = get_spec("deepseek_v3")
    exported = spec.hf.to_hf(model.state_dict(), model.args)
    layer = model.args.n_layers
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "shared_head.head.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.7.up_proj.weight",
                 "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.{layer}.{name}" in exported, name
    back = spec.hf.from_hf(exported, model.args)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    plain = _mtp_model(0)
    with caplog.at_level("INFO"):
        without = spec.hf.from_hf(exported, plain.args)
    assert without.keys() == plain.state_dict().keys()
    assert f"layers [{layer}] of the checkpoint (multi-token prediction) set aside" in caplog.text


# Expert parallelism with balancing on (the bias moves from the load summed over the ranks, the sequence-wise loss
# is per sequence) and multi-token prediction: every term is the same whichever rank holds a sequence or an expert.
# Pipeline parallelism: 2 stages of layers [0, 1] (the dense layer first) and [2, 3], the score bias moving (each
# stage moves its own layers' biases, from their load summed over the stage's data-parallel ranks).
# Tensor parallelism: MLA's heads split, the low-rank path and the MoE layers replicated, the score bias moving.
# Context parallelism (ring and Ulysses): MLA's q/k/v through the context seam at the chunks' true RoPE positions,
# the sequence-wise loss's counts and the bias's load summed over the cp ranks.
# On 4 ranks: EP 2 within FSDP 4 (the experts' FSDP over 2), EP 2 on each of 2 pipeline stages, FSDP 2 x TP 2.
BALANCING = ["--model.score_bias_rate", "0.01"]
SEQ_AUX = [*BALANCING, "--model.seq_aux_loss_coef", "0.1"]  # weighty enough that counts not pooled over cp would show
# id -> (model overrides, layout overrides, ranks).
LAYOUTS = {
    "ep-balancing-mtp": ([*BALANCING, "--model.seq_aux_loss_coef", "0.001", "--model.mtp_depth", "1"],
                         ["--parallel.ep_degree", "2", "--training.batch_size", "2"], 2),
    "pp-balancing": (BALANCING, ["--parallel.pp_degree", "2", "--training.batch_size", "4"], 2),
    "tp-balancing": (BALANCING, ["--parallel.tp_degree", "2", "--training.batch_size", "4"], 2),
    "cp-ring": (SEQ_AUX, ["--parallel.cp_degree", "2", "--training.batch_size", "4"], 2),
    "cp-ulysses": (SEQ_AUX, ["--parallel.cp_degree", "2", "--parallel.cp_mode", "ulysses", "--training.batch_size",
                             "4"], 2),
    "ep2-fsdp4": ([*BALANCING, "--model.seq_aux_loss_coef", "0.001"],
                  ["--parallel.ep_degree", "2", "--parallel.dp_shard", "4", "--training.batch_size", "1"], 4),
    "pp2-ep2": (BALANCING, ["--parallel.pp_degree", "2", "--parallel.ep_degree", "2", "--parallel.dp_shard", "2",
                            "--training.batch_size", "2", "--parallel.pp_microbatches", "2"], 4),
    "fsdp2-tp2": (BALANCING, ["--parallel.dp_shard", "2", "--parallel.tp_degree", "2", "--training.batch_size", "2"],
                  4),
    "cp2-tp2": (BALANCING, ["--parallel.cp_degree", "2", "--parallel.tp_degree", "2", "--training.batch_size", "4"],
                4),
    "cp2-ep2": (SEQ_AUX, ["--parallel.cp_degree", "2", "--parallel.ep_degree", "2", "--training.batch_size", "4"],
                2),  # the experts split over the two cp ranks
}
# The 4-rank EP x FSDP, FSDP x TP and CP x TP runs and CP x EP are slow: the 2-rank EP, TP and CP runs stay in the
# default run; EP x PP stays too (the bias from a stage's load summed over its dp ranks).
SLOW_LAYOUTS = ("ep2-fsdp4", "fsdp2-tp2", "cp2-tp2", "cp2-ep2")
LAYOUT_TEST = "test_expert_pipeline_tensor_and_context_parallel_layouts_give_the_single_process_losses"


def _one_process_run(model: list[str]) -> str:
    """The name of one process's run of the model overrides `model`: 'one_score_bias_rate_0.01' for BALANCING."""
    return "_".join(["one", *(arg.removeprefix("--model.") for arg in model)])


@pytest.fixture(scope="module")
def layout_runs(request, tmp_path_factory) -> Path:
    """The selected layouts' 3-step runs, in one 2-rank and one 4-rank pool of processes (a launch each instead of
    one per layout), logging to <dir>/<id>; and one process's run of each of their models (_one_process_run)."""
    from parallel.harness import config_run, run_pools, selected_ids

    work = tmp_path_factory.mktemp("deepseek_layouts")
    names = selected_ids(request, LAYOUT_TEST)
    pools: dict[int, list] = {}
    for name in names:
        model, layout, ranks = LAYOUTS[name]
        pools.setdefault(ranks, []).append(config_run(CONFIG, [
            *SHORT, "--training.max_steps", "3", "--metrics.log_dir", str(work / name), "--checkpoint.enable", "false",
            *model, *layout]))
    models = {_one_process_run(LAYOUTS[name][0]): LAYOUTS[name][0] for name in names}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _as_one_cpu_process(monkeypatch)
            for run, model in models.items():
                _train(work / run, *model, steps=3)
    finally:
        torch.set_num_threads(threads)
    run_pools(pools)
    return work


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
                                  for name in LAYOUTS])
def test_expert_pipeline_tensor_and_context_parallel_layouts_give_the_single_process_losses(layout_runs, name):
    model, layout, _ = LAYOUTS[name]
    single, split = _records(layout_runs / _one_process_run(model) / "logs"), _records(layout_runs / name)
    assert len(split) == 3
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    if "--model.mtp_depth" in model:
        assert [r["mtp_loss"] for r in split] == pytest.approx([r["mtp_loss"] for r in single], rel=1e-5)
    if "--parallel.pp_degree" not in layout:  # the pipeline's stages log no expert load of the whole model
        assert [r["expert_load_per_layer"] for r in split] == [r["expert_load_per_layer"] for r in single]
    if "--parallel.cp_degree" in layout:  # the pooled balance diagnostic, its counts summed over the cp ranks (data
        # parallel ranks each pool their own sequences: a mean of per-rank values, not one process's)
        assert [r["aux_loss"] for r in split] == pytest.approx([r["aux_loss"] for r in single], rel=1e-5)


@pytest.mark.parametrize("config, dense", [(CONFIG, "--model.first_k_dense=2"),
                                           (ROOT / "configs" / "debug_moe.toml", "--model.mlp_only_layers=[0,1]")],
                         ids=["deepseek_v3", "qwen3_moe"])
def test_a_pipeline_stage_of_dense_layers_still_reports_every_moe_layers_row(config, dense):
    # The log step all-reduces expert_tokens over every rank: a stage holding no MoE layer must take part with zero
    # rows of the same shape, or the stages' collectives mismatch and the run dies at its first log step.
    from titan_npu.models.decoder.pipeline import build_stage

    args = build_model_args(load_config(config, ["--model.n_layers=4", dense]).model)
    model = build_model(args)
    torch.manual_seed(0)
    model.init_weights(seed=0)
    dense_stage = build_stage(model, [0, 1], is_first=True, is_last=False)
    dense_stage(torch.randint(0, args.vocab_size, (2, 16)))
    metrics = dense_stage.routing_metrics()
    assert metrics["expert_tokens"].shape == (args.n_moe_layers, args.n_experts)
    assert not metrics["expert_tokens"].any()

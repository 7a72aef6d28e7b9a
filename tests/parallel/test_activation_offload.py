"""activation_checkpoint.offload: the blocks activation checkpointing keeps move their saved activations out
during forward and take them back in backward, and the loss and every gradient are bit-identical to the same run
without offload (no AC, selective AC, a MoE family); what moves is a copy (the saved tensor autograd hands back is
not the forward's), parameters and small tensors stay; a whole run trains the same losses; on cpu the run says
once that offload gains nothing there; full AC, op-level selective AC and compile are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_run import refusal_line, tiny_args
from torch import nn

from titan_npu import ops
from titan_npu.config.loader import load_config
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel import ParallelDims
from titan_npu.parallel.activation_offload import ActivationOffload
from titan_npu.parallel.parallelize import build_model_parts

TINY = ["--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", "256", "--model.max_seq_len", "64", "--training.seq_len", "32",
        "--training.dtype", "fp32"]
MOE = ["--model.name", "qwen3_moe", "--model.dim", "64", "--model.n_layers", "2", "--model.vocab_size", "256",
       "--training.seq_len", "32", "--training.dtype", "fp32"]


def _loss_and_grads(args: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor], ActivationOffload | None]:
    ops.set_kernels("reference")
    cfg = load_config(None, args)
    model_args = build_model_args(cfg.model)
    _, (model,) = build_model_parts(spec_of(model_args), cfg, ParallelDims.from_config(cfg.parallel, 1), model_args,
                                    torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, getattr(model, "activation_offload", None)


@pytest.mark.parametrize("family, ac", [
    ("llama3", []),
    ("llama3", ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_every", "2"]),
    ("qwen3_moe", []),
])
def test_offload_gives_bit_identical_loss_and_gradients(family, ac):
    base = (TINY if family == "llama3" else MOE) + ac
    loss, grads, none = _loss_and_grads(base)
    off_loss, off_grads, offload = _loss_and_grads(base + ["--activation_checkpoint.offload", "true",
                                                           "--activation_checkpoint.offload_min_bytes", "4096"])
    assert none is None and offload is not None and offload.moved_tensors > 0
    assert torch.equal(loss, off_loss)
    assert grads.keys() == off_grads.keys()
    assert all(torch.equal(grads[name], off_grads[name]) for name in grads), \
        [name for name in grads if not torch.equal(grads[name], off_grads[name])]


def test_selective_ac_offloads_only_the_blocks_it_keeps():
    offload = ["--activation_checkpoint.offload", "true", "--activation_checkpoint.offload_min_bytes", "0"]
    *_, every = _loss_and_grads(TINY + offload)
    *_, half = _loss_and_grads(TINY + offload + ["--activation_checkpoint.mode", "selective",
                                                 "--activation_checkpoint.selective_every", "2"])
    # Four identical blocks: selective_every = 2 recomputes blocks 1 and 3, so half of the tensors move.
    assert every.moved_tensors == 2 * half.moved_tensors and every.moved_bytes == 2 * half.moved_bytes


def test_what_moves_is_a_copy_and_parameters_and_small_tensors_stay():
    block = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    offload = ActivationOffload(min_bytes=64 * 4 + 1)  # more than one row: a [1, 64] input stays
    offload.install(block, 0)
    x = torch.randn(8, 64, requires_grad=True)
    y = block(x)
    saved = y.grad_fn._saved_result  # tanh's output, unpacked through the hooks
    assert torch.equal(saved, y) and saved.data_ptr() != y.data_ptr()
    assert offload.moved_tensors == 2  # tanh's output and the linear's input, not its weight
    small = block(torch.randn(1, 64, requires_grad=True))
    assert small.grad_fn._saved_result.data_ptr() == small.data_ptr() and offload.moved_tensors == 2
    y.sum().backward()
    assert x.grad is not None


def _losses(run) -> list[float]:
    lines = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def test_a_run_with_offload_trains_the_same_losses_and_warns_once_on_cpu(tmp_path, capsys):
    from titan_npu.cli import main

    extra = dict(training__max_steps=3, checkpoint__enable=False, activation_checkpoint__offload_min_bytes=0)
    assert main(["train", *tiny_args(tmp_path / "plain", **extra)]) == 0
    capsys.readouterr()
    assert main(["train", *tiny_args(tmp_path / "offload", activation_checkpoint__offload=True, **extra)]) == 0
    out, err = capsys.readouterr()
    assert (out + err).count("activation_checkpoint.offload on cpu") == 1
    assert _losses(tmp_path / "offload") == _losses(tmp_path / "plain") and len(_losses(tmp_path / "plain")) == 3


@pytest.mark.parametrize("extra, names", [
    ({"activation_checkpoint__mode": "full"}, ["mode = 'full'"]),
    ({"activation_checkpoint__mode": "selective", "activation_checkpoint__selective_ops": True},
     ["selective_ops = true"]),
    ({"compile__enable": True}, ["compile.enable = true"]),
])
def test_offload_with_nothing_kept_or_with_compile_is_refused_in_one_line(tmp_path, capsys, extra, names):
    line = refusal_line(capsys, ["train", *tiny_args(tmp_path / "run", activation_checkpoint__offload=True,
                                                     **extra)])
    assert line.startswith("ConfigError: ") and "activation_checkpoint.offload = true with " in line, line
    assert all(name in line for name in names), line
    assert not (tmp_path / "run").exists()

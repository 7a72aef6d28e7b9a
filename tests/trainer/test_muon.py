"""optimizer.name = "Muon": one process's step equals a Muon step written from its description (Keller Jordan's
post; Moonshot's update-RMS scaling) to 1e-6 in fp32, plain matrices step exactly as torch.optim.Muon, and the
parameter groups put embeddings, the output and 1-D parameters on AdamW."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from titan_npu.config.loader import load_config
from titan_npu.config.schema import OptimizerConfig
from titan_npu.errors import ConfigError
from titan_npu.trainer.optimizer import build_optimizer

A, B, C = 3.4445, -4.775, 2.0315
STEPS = 3


class Tiny(nn.Module):
    """An embedding, a wide and a tall matrix, stacked experts [E, out, in], a norm and an output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(20, 8)
        self.wide = nn.Linear(8, 12, bias=False)  # weight [12, 8]: more rows than columns
        self.narrow = nn.Linear(12, 8, bias=False)  # weight [8, 12]
        self.experts = nn.Parameter(torch.randn(3, 6, 8) * 0.3)
        self.norm = nn.Parameter(torch.ones(8))
        self.output = nn.Linear(8, 20, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = self.narrow(torch.tanh(self.wide(h)))
        h = h + torch.einsum("btd,eod->bto", h, self.experts).tanh().sum(-1, keepdim=True)
        return self.output(h * self.norm)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 20, (2, 5), generator=generator)
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, -1).flatten())


def _reference_orthogonalize(m: torch.Tensor, steps: int) -> torch.Tensor:
    """X <- a X + (b XX^T + c (XX^T)^2) X from X = M / ||M||_F, on the wide orientation of M."""
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.T if m.shape[0] > m.shape[1] else x


def _reference_muon(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float, wd: float,
                    momentum: float = 0.95) -> None:
    """buf <- momentum buf + (1 - momentum) g; Nesterov u = (1 - momentum) g + momentum buf; each matrix
    orthogonalised, scaled by 0.2 sqrt(max(A, B)) (the update RMS of AdamW); decoupled weight decay."""
    buf.mul_(momentum).add_(grad, alpha=1 - momentum)
    update = (1 - momentum) * grad + momentum * buf
    matrices = update.reshape(-1, *update.shape[-2:])
    ortho = torch.stack([_reference_orthogonalize(m, 5) for m in matrices]).reshape(update.shape)
    scale = 0.2 * math.sqrt(max(update.shape[-2:]))
    param.mul_(1 - lr * wd).sub_(lr * scale * ortho)


def test_one_process_step_equals_a_reference_muon_step_from_the_paper():
    lr, wd = 0.02, 0.1
    cfg = OptimizerConfig(name="Muon", lr=lr, weight_decay=wd, muon_ns_dtype="fp32", implementation="for-loop")
    model, reference = Tiny(), Tiny()
    optimizer = build_optimizer([model], cfg, "cpu")
    # AdamW for what Muon does not take: the embedding and output (decayed), the norm (not decayed).
    adamw = torch.optim.AdamW([{"params": [reference.tok_embeddings.weight, reference.output.weight]},
                               {"params": [reference.norm], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, foreach=False)
    muon_params = [reference.wide.weight, reference.narrow.weight, reference.experts]
    buffers = [torch.zeros_like(p) for p in muon_params]
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()
        reference.zero_grad()
        _loss(reference, step).backward()
        adamw.step()
        with torch.no_grad():
            for p, buf in zip(muon_params, buffers):
                _reference_muon(p, p.grad, buf, lr, wd)
        got, want = dict(model.named_parameters()), dict(reference.named_parameters())
        for name in want:  # relative to the tensor's norm: elementwise, a near-zero entry would measure rounding
            rel = ((got[name] - want[name]).norm() / want[name].norm()).item()
            assert rel <= 1e-6, f"step {step + 1}, {name}: rel {rel:.2e}"


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_plain_matrices_step_bit_for_bit_as_torch_optim_muon(adjust_lr):
    cfg = OptimizerConfig(name="Muon", lr=0.01, weight_decay=0.1, implementation="for-loop",
                          muon_exclude=["tok_embeddings.*", "output.*", "experts"], muon_adjust_lr=adjust_lr)
    model, reference = Tiny(), Tiny()
    optimizer = build_optimizer([model], cfg, "cpu")
    matrices = [reference.wide.weight, reference.narrow.weight]
    others = [reference.tok_embeddings.weight, reference.experts, reference.output.weight]
    references = [torch.optim.Muon(matrices, lr=0.01, weight_decay=0.1, adjust_lr_fn=adjust_lr),
                  torch.optim.AdamW([{"params": others}, {"params": [reference.norm], "weight_decay": 0.0}],
                                    lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)]
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()
        reference.zero_grad()
        _loss(reference, step).backward()
        for torch_optimizer in references:
            torch_optimizer.step()
        for name, want in reference.named_parameters():
            assert torch.equal(model.get_parameter(name), want), f"step {step}: {name}"


def test_muon_groups_take_the_hidden_matrices_and_stacked_experts_and_leave_the_rest_to_adamw():
    cfg = load_config("configs/debug_moe.toml", ["--optimizer.name=muon"])
    from titan_npu.models.registry import build_model, build_model_args

    model = build_model(build_model_args(cfg.model))
    optimizer = build_optimizer([model], cfg.optimizer, "cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"])
    adamw = sorted(names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"])
    assert "layers.0.attention.wq.weight" in muon and "layers.0.feed_forward.experts.w1" in muon
    assert "layers.0.feed_forward.router.gate.weight" in muon
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.ffn_norm.weight"} <= set(adamw)
    assert all(model.get_parameter(n).ndim < 2 for n in adamw if n not in ("tok_embeddings.weight", "output.weight"))
    assert len(muon) + len(adamw) == len(names)


def test_muon_exclude_patterns_move_matrices_to_adamw():
    cfg = OptimizerConfig(name="Muon", muon_exclude=["tok_embeddings.*", "output.*", "experts", "wide.*"])
    optimizer = build_optimizer([Tiny()], cfg, "cpu")
    (muon,) = [g for g in optimizer.param_groups if g["muon"]]
    assert [tuple(p.shape) for p in muon["params"]] == [(8, 12)]


@pytest.mark.parametrize("override, message", [
    ("--optimizer.muon_ns_dtype=fp8", "optimizer.muon_ns_dtype"),
    ("--optimizer.muon_momentum=1.0", "optimizer.muon_momentum"),
    ("--optimizer.muon_adjust_lr=spectral", "optimizer.muon_adjust_lr"),
    ("--optimizer.muon_ns_coefficients=[3.4,-4.7]", "optimizer.muon_ns_coefficients"),
    ("--optimizer.muon_ns_steps=0", "optimizer.muon_ns_steps"),
])
def test_bad_muon_settings_are_refused_with_the_key_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", ["--optimizer.name=Muon", override])

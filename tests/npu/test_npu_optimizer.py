"""On an NPU the optimizer is torch_npu's fused AdamW when it applies (plain tensors), else torch's foreach AdamW."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titan_npu.config.schema import OptimizerConfig
from titan_npu.trainer.optimizer import build_optimizer, param_groups

CFG = OptimizerConfig(name="AdamW", lr=1e-2, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.3)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 2))


def take_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()


def test_npu_uses_npu_fused_adamw_with_the_configured_hyperparameters(fake_torch_npu):
    model, expected_model = tiny_model(), tiny_model()
    opt = build_optimizer([model], CFG, "npu")
    assert isinstance(opt, fake_torch_npu.optim.NpuFusedAdamW)
    expected = torch.optim.AdamW(param_groups([expected_model], CFG.weight_decay), lr=CFG.lr,
                                 betas=tuple(CFG.betas), eps=CFG.eps, foreach=False)
    take_step(model, opt)
    take_step(expected_model, expected)
    for got, want in zip(model.parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]  # no decay on norms and biases


def test_npu_with_sharded_parameters_uses_foreach_adamw(fake_torch_npu):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(4, 4, bias=False)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh))
        opt = build_optimizer([model], CFG, "npu")
        assert type(opt) is torch.optim.AdamW and opt.defaults["foreach"] is True
    finally:
        dist.destroy_process_group()


def test_npu_without_torch_npu_falls_back_to_foreach():
    opt = build_optimizer([tiny_model()], CFG, "npu")
    assert type(opt) is torch.optim.AdamW and opt.defaults["foreach"] is True

"""On an NPU the optimizer is torch's fused AdamW, whose _fused_adamw_ kernel torch_npu registers for the device;
torch_npu.optim's NpuFusedAdamW (the wheel's own code runs here) cannot serve the trainer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_npu.config.schema import OptimizerConfig
from titan_npu.trainer.optimizer import build_optimizer, param_groups

CFG = OptimizerConfig(name="AdamW", lr=1e-2, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.3)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 2)).to(dtype)


def take_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    dtype = next(model.parameters()).dtype
    model(torch.randn(4, 6, dtype=dtype)).float().square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # what the trainer calls after every step, and DCP on save and resume


def test_npu_uses_torch_fused_adamw_with_the_configured_hyperparameters(fake_torch_npu):
    model, expected_model = tiny_model(), tiny_model()
    opt = build_optimizer([model], CFG, "npu")
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    expected = torch.optim.AdamW(param_groups([expected_model], CFG.weight_decay), lr=CFG.lr,
                                 betas=tuple(CFG.betas), eps=CFG.eps, foreach=False)
    for _ in range(2):
        take_step(model, opt)
        take_step(expected_model, expected)
    for got, want in zip(model.parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]  # no decay on norms and biases


def test_npu_optimizer_steps_pure_bf16_parameters(fake_torch_npu):
    model = tiny_model(dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    take_step(model, build_optimizer([model], CFG, "npu"))
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_the_wheels_npu_fused_adamw_refuses_what_the_trainer_needs(fake_torch_npu):
    # The reason it is not used: the pinned wheel's own optimizer code, as shipped.
    model = tiny_model()
    opt = fake_torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="set_to_none is not supported"):
        opt.zero_grad(set_to_none=True)
    bf16 = tiny_model(dtype=torch.bfloat16)
    bf16(torch.randn(2, 6, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(TypeError, match="float32 or float16"), pytest.warns(UserWarning, match="TypedStorage"):
        fake_torch_npu.optim.NpuFusedAdamW(bf16.parameters(), lr=1e-3).zero_grad()


def test_torch_fused_adamw_calls_the_kernel_schema_torch_npu_registers(each_torch_npu_wheel):
    wheel = torch._C.parse_schema("aten::" + each_torch_npu_wheel.aten_schema("_fused_adamw_"))
    assert str(torch.ops.aten._fused_adamw_.default._schema) == str(wheel)


def test_npu_with_sharded_parameters_uses_fused_adamw_too(fake_torch_npu):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(4, 4, bias=False)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh))
        opt = build_optimizer([model], CFG, "npu")
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
        model.weight.grad = distribute_tensor(torch.ones(4, 4), mesh)
        opt.step()  # the fused kernel takes DTensor parameters (FSDP's) too
    finally:
        dist.destroy_process_group()


def test_npu_without_torch_npu_still_builds_fused_adamw():
    opt = build_optimizer([tiny_model()], CFG, "npu")
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True

"""Muon (momentum orthogonalised by Newton-Schulz iterations) for the hidden matrices, AdamW for the rest, in one
optimizer that works on plain tensors and on FSDP2 / tensor- / expert-parallel DTensors alike.

The math is torch.optim.Muon's (Keller Jordan's Muon; Moonshot's update-RMS scaling): per Muon parameter
    B <- lerp(B, G, 1 - momentum);  U <- lerp(G, B, momentum) if nesterov else B
    O <- NewtonSchulz(U);  W <- W (1 - lr wd) - lr scale(shape) O
Only the orthogonalisation needs the whole matrix: the momentum buffer stays sharded like its parameter, the
update is gathered over the mesh dims that cut one of the matrix's last two dims, orthogonalised (stacked MoE
experts [E, out, in] one expert at a time, batched over dim 0, so the experts' own sharding is never gathered),
and this rank's shard is taken back. torch.optim.Muon itself takes only plain 2-D tensors and always iterates in
bf16; this step is the same arithmetic (equal to it bit for bit on those) in any dtype and layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS
from torch.optim.adam import adam

from titan_npu.trainer.state_dtype import adam_group_step, closure_loss, narrow_moments

# torch.optim.Muon's defaults: Keller Jordan's quintic coefficients and the normalisation's floor.
NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(update: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of each matrix in the last two dims."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonalize(update: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """newton_schulz of the whole matrices of `update`; a DTensor comes back with its own placements."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, coefficients, steps, eps, dtype)
    mesh, placements = update.device_mesh, tuple(update.placements)
    matrix_dims = (update.ndim - 2, update.ndim - 1)
    # Keep a sharding of the leading (expert) dim and replicas; gather the shards of the matrices themselves.
    whole = tuple(p if isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % update.ndim not in matrix_dims)
                  else Replicate() for p in placements)
    gathered = update.redistribute(mesh, whole)
    local = newton_schulz(gathered.to_local(), coefficients, steps, eps, dtype)
    out = DTensor.from_local(local, mesh, whole, run_check=False, shape=update.shape, stride=update.stride())
    return out.redistribute(mesh, placements)


def lr_scale(shape: Sequence[int], adjust_lr: str) -> float:
    """The factor on lr for a matrix of `shape` (its last two dims): match_rms_adamw gives the update AdamW's RMS
    (0.2 sqrt(max(A, B)), Moonshot), original is Keller Jordan's sqrt(max(1, A / B)), none is 1."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


class Muon(torch.optim.AdamW):
    """AdamW whose param groups with `muon: True` take the Muon step instead (one optimizer, one state dict)."""

    def __init__(self, params, *, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: Sequence[float] = NS_COEFFICIENTS, ns_steps: int = 5, ns_eps: float = EPS,
                 ns_dtype: str = "bf16", adjust_lr: str = "match_rms_adamw",
                 state_dtype: torch.dtype = torch.float32, **adamw_kwargs) -> None:
        super().__init__(params, **adamw_kwargs)
        self.state_dtype = state_dtype  # the AdamW groups' moments (trainer/state_dtype.py); Muon's buffer: fp32
        self.register_load_state_dict_post_hook(narrow_moments)
        muon_defaults = {"muon": False, "momentum": momentum, "nesterov": nesterov,
                         "ns_coefficients": tuple(ns_coefficients), "ns_steps": ns_steps, "ns_eps": ns_eps,
                         "ns_dtype": ns_dtype, "adjust_lr": adjust_lr}
        self.defaults.update(muon_defaults)
        for group in self.param_groups:
            for key, value in muon_defaults.items():
                group.setdefault(key, value)
            if group["muon"] and any(p.ndim < 2 for p in group["params"]):
                raise ValueError("Muon param groups take matrices (or stacks of them) only")
        # The Muon groups do not honour a device-side found_inf: the skip guard must not rely on one.
        self._step_supports_amp_scaling = False

    def __setstate__(self, state: dict) -> None:
        # Optimizer's own: Adam's also upgrades older torch versions' states by reading every state's step, which
        # Muon's states do not have (and no older state of this optimizer exists).
        torch.optim.Optimizer.__setstate__(self, state)

    @torch.no_grad()
    def step(self, closure=None):
        """One step: Muon on the `muon` groups, torch's AdamW on the others."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum, dtype = group["lr"], group["momentum"], NS_DTYPES[group["ns_dtype"]]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["ns_eps"], dtype)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * lr_scale(p.shape, group["adjust_lr"]))

    def _adamw_step(self, group: dict) -> None:
        if self.state_dtype != torch.float32:
            adam_group_step(self, group, self.state_dtype)
            return
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
             differentiable=group["differentiable"], fused=group["fused"],
             grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
             decoupled_weight_decay=group["decoupled_weight_decay"])

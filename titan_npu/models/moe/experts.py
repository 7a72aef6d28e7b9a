"""The routed experts: n_experts SwiGLU MLPs held as stacked weights [n_experts, out, in], computed over the tokens
sorted by expert as one grouped GEMM per projection (ops.grouped_mm), never a Python loop over experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_npu import ops
from titan_npu.models.init import ParamInit, constant, trunc_normal
from titan_npu.models.moe.dispatch import fill_slots, read_slots, scale_grad


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gating: (up + 1) * gate * sigmoid(alpha * gate), the gate clamped to at most `limit` and the up
    projection to [-limit, limit] first."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GroupedExperts(nn.Module):
    """w1 (gate) and w3 (up) [n_experts, ffn_dim, dim], w2 (down) [n_experts, dim, ffn_dim]: expert e computes
    w2[e] (silu(w1[e] x) * w3[e] x), as the dense FeedForward does with its Linear weights.

    bias: each projection adds its expert's bias (b1, b3 [n_experts, ffn_dim], b2 [n_experts, dim]); swiglu_limit:
    the gating is clamped_swiglu's (gpt-oss) instead of silu(gate) * up."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int, *, bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.b1: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        self.b3: nn.Parameter | None = None
        if bias:
            self.b1 = nn.Parameter(torch.empty(n_experts, ffn_dim))
            self.b2 = nn.Parameter(torch.empty(n_experts, dim))
            self.b3 = nn.Parameter(torch.empty(n_experts, ffn_dim))
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        # The share of the down-projection bias b2 this rank adds: 1 / tp under tensor parallelism (parallelize.py),
        # whose ranks' partial outputs are summed.
        self.bias_share = 1.0
        # Under expert parallelism (dispatch.py) the weights are DTensors sharded on the expert dim over the ep
        # ranks; a rank's local experts see every ep rank's tokens, so their gradient is scaled by 1 / ep to be the
        # data-parallel mean that FSDP takes of the other parameters.
        self.grad_scale = 1.0
        # A float8 grouped GEMM with ops.grouped_mm's signature that float8 conversion installs (float8.moe_experts,
        # parallel/float8.py); None: the high-precision ops.grouped_mm. The weights stay as they are either way.
        self.float8_grouped_mm: Callable[..., torch.Tensor] | None = None

    def _weights(self, x: torch.Tensor, params: tuple[str, ...] = ("w1", "w2", "w3")) -> tuple[torch.Tensor, ...]:
        """This rank's experts' weights (or the named parameters) in the compute dtype: autocast's when it is on (it
        does not cover grouped GEMMs)."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        weights = []
        for w in (getattr(self, name) for name in params):
            if isinstance(w, DTensor):  # (compile traces isinstance, not hasattr, of a DTensor parameter)
                w = scale_grad(w.to_local(), self.grad_scale)
            weights.append(w if w.dtype == dtype else w.to(dtype))
        return tuple(weights)

    def _down_bias(self, x: torch.Tensor) -> torch.Tensor:
        """b2 in the compute dtype times bias_share; its gradient, the same on every tensor-parallel rank, scaled
        back up to the whole bias's."""
        (b2,) = self._weights(x, ("b2",))
        if self.bias_share == 1.0:
            return b2
        return scale_grad(b2, 1.0 / self.bias_share) * self.bias_share

    def _gating(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return ops.swiglu(gate, up)
        return clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_group_rows: int) -> torch.Tensor:
        """x [N, dim]: the rows of expert e are offsets[e-1]:offsets[e] (int32 cumulative ends); at most
        max_group_rows per expert. Returns [N, dim] in the same order."""
        w1, w2, w3 = self._weights(x)
        x = x.to(w1.dtype)
        grouped_mm = self.float8_grouped_mm or ops.grouped_mm
        gate = grouped_mm(x, w1, offsets, max_group_rows)
        up = grouped_mm(x, w3, offsets, max_group_rows)
        if self.b1 is None:
            return grouped_mm(self._gating(gate, up), w2, offsets, max_group_rows)
        b1, b3 = self._weights(x, ("b1", "b3"))
        b2 = self._down_bias(x)
        # Each row's expert, from the cumulative ends (no host read).
        expert = torch.searchsorted(offsets.long(), torch.arange(x.shape[0], device=x.device), right=True)
        expert = expert.clamp_(max=b1.shape[0] - 1)
        hidden = self._gating(gate + b1[expert], up + b3[expert])
        return grouped_mm(hidden, w2, offsets, max_group_rows) + b2[expert]

    def forward_padded(self, x: torch.Tensor, expert: torch.Tensor, slot: torch.Tensor, capacity: int
                       ) -> torch.Tensor:
        """Capacity routing: row i of x [N, dim] goes to `slot[i]` of expert `expert[i]`'s `capacity` slots (slot ==
        capacity: dropped). One batched matmul per projection over [n_experts, capacity, dim]; dropped rows
        return zeros."""
        return read_slots(self.forward_batched(fill_slots(x, expert, slot, self.w1.shape[0], capacity)), expert, slot)

    def forward_batched(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [experts held here, rows, dim]: the rows of each expert (empty rows zero). One batched matmul per
        projection (converted to float8: one grouped GEMM over the experts' slots); returns [experts held here, rows,
        dim]."""
        if self.float8_grouped_mm is not None:
            experts, rows, dim = slots.shape
            offsets = torch.arange(1, experts + 1, device=slots.device, dtype=torch.int32) * rows
            flat = self.forward(slots.reshape(experts * rows, dim), offsets, rows)
            return flat.view(experts, rows, -1)
        w1, w2, w3 = self._weights(slots)
        slots = slots.to(w1.dtype)
        gate, up = torch.bmm(slots, w1.transpose(1, 2)), torch.bmm(slots, w3.transpose(1, 2))
        if self.b1 is None:
            return torch.bmm(self._gating(gate, up), w2.transpose(1, 2))
        b1, b3 = self._weights(slots, ("b1", "b3"))
        b2 = self._down_bias(slots)
        hidden = self._gating(gate + b1.unsqueeze(1), up + b3.unsqueeze(1))
        return torch.bmm(hidden, w2.transpose(1, 2)) + b2.unsqueeze(1)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Gate and up ~ N(0, 0.02); down, which writes into the residual stream, ~ N(0, init_std); biases 0."""
        inits = {"w1": trunc_normal(0.02), "w3": trunc_normal(0.02), "w2": trunc_normal(init_std)}
        if self.b1 is not None:
            inits.update({"b1": constant(0.0), "b2": constant(0.0), "b3": constant(0.0)})
        return inits


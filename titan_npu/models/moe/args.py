"""The shape and routing options of one mixture-of-experts layer, independent of the family that uses it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_npu.errors import ConfigError
from titan_npu.knobs import Knob, at_least, off_key, size_key, switch_key

# The mixture-of-experts [model] keys with the values each accepts; a MoE family takes those it reads (the MoE
# decoder every one of them, DeepSeek-V3 and gpt-oss the routing ones).
MOE_KEYS: dict[str, Knob] = {
    "n_experts": size_key(),  # routed experts per MoE layer
    "top_k": size_key(),  # experts each token is routed to
    "moe_ffn_dim": size_key(),  # SwiGLU width of one routed expert
    "norm_topk_prob": switch_key(),  # renormalise a token's top-k weights to sum to 1
    "decoder_sparse_step": size_key(),  # every n-th layer is MoE (1 = all)
    "mlp_only_layers": Knob(at_least(0), why="layer ids count from 0", each=True, kind=list[int]),  # kept dense
    "router_aux_loss_coef": off_key(),  # weight of the load-balancing loss in the optimised loss
    "capacity_factor": off_key(),  # expert capacity = factor x tokens x top_k / n_experts; 0 = dropless
    "shared_ffn_dim": off_key(int),  # width of an always-on shared expert; 0 = none
}


@dataclass(frozen=True)
class MoEArgs:
    """One MoE feed-forward: n_experts SwiGLU experts of width ffn_dim, top_k of them per token."""

    dim: int
    n_experts: int
    top_k: int
    ffn_dim: int  # width of one routed expert
    norm_topk_prob: bool = True  # renormalise the top-k weights of a token to sum to 1
    # Tokens an expert takes per forward = ceil(capacity_factor * tokens * top_k / n_experts); assignments past it
    # are dropped (their weight is lost, the residual carries the token). None = dropless.
    capacity_factor: float | None = None
    shared_ffn_dim: int = 0  # width of an always-on shared SwiGLU expert added to the routed output; 0 = none
    # Qwen3-Next: the shared expert's output times sigmoid(x @ w) of a learned w [dim] per token (shared_gate).
    shared_gate: bool = False
    # A per-expert bias added to the scores for the choice of experts only (aux-loss-free balancing, DeepSeek-V3);
    # False = no bias buffer at all.
    score_bias: bool = False
    # How tokens choose experts: "softmax" (router.Router: softmax top-k, Qwen3-MoE) or "sigmoid_group"
    # (group_router.GroupRouter: sigmoid scores, top-k within the best topk_groups of n_groups expert groups, the
    # chosen weights times route_scale; DeepSeek-V3).
    router: str = "softmax"
    n_groups: int = 1
    topk_groups: int = 1
    route_scale: float = 1.0
    # gpt-oss: a bias on the router's gate and on each expert's three projections, and the clamped SwiGLU
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate) with gate <= swiglu_limit and |up| <= swiglu_limit
    # (experts.clamped_swiglu); swiglu_limit None = the plain SwiGLU.
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for key in ("dim", "n_experts", "top_k", "ffn_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")
        if self.top_k > self.n_experts:
            raise ConfigError(f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts}; "
                              f"route each token to at most n_experts experts")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"model.capacity_factor={self.capacity_factor} must be positive, or 0 / unset for "
                              f"dropless routing")
        if self.router not in ("softmax", "sigmoid_group"):
            raise ConfigError(f"router {self.router!r} is not a MoE router (valid: softmax, sigmoid_group)")
        if self.n_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups:
            raise ConfigError(f"model.n_groups={self.n_groups} must divide model.n_experts={self.n_experts} and "
                              f"model.topk_groups={self.topk_groups} lie in 1..n_groups")
        if self.n_groups > 1 and (self.n_experts // self.n_groups < 2
                                  or self.top_k > self.topk_groups * (self.n_experts // self.n_groups)):
            raise ConfigError(f"model.top_k={self.top_k} experts must fit in the topk_groups={self.topk_groups} chosen "
                              f"groups of {self.n_experts // self.n_groups} experts (at least 2 per group); raise "
                              f"model.topk_groups or lower model.n_groups")
        if self.shared_ffn_dim < 0:
            raise ConfigError(f"model.shared_ffn_dim={self.shared_ffn_dim} must be 0 (no shared expert) or positive")
        if self.shared_gate and not self.shared_ffn_dim:
            raise ConfigError("a shared-expert gate needs a shared expert; set model.shared_ffn_dim")

    def capacity(self, n_tokens: int) -> int:
        """Assignments one expert takes from n_tokens tokens: the capacity, or n_tokens when dropless (an expert
        is chosen at most once per token)."""
        if self.capacity_factor is None:
            return n_tokens
        return min(n_tokens, max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)))

    def active_params(self) -> int:
        """Parameters one token meets in this layer: the router, top_k experts and the shared expert."""
        return (self.n_experts * self.dim + (self.top_k * self.ffn_dim + self.shared_ffn_dim) * 3 * self.dim
                + self._bias_params(self.top_k) + self.dim * self.shared_gate)

    def total_params(self) -> int:
        """Every parameter of the layer."""
        return (self.n_experts * self.dim + (self.n_experts * self.ffn_dim + self.shared_ffn_dim) * 3 * self.dim
                + self._bias_params(self.n_experts) + self.dim * self.shared_gate)

    def _bias_params(self, experts: int) -> int:
        """The router's bias and the biases of `experts` experts (2 ffn_dim + dim each), where the layer has them."""
        return self.n_experts * self.router_bias + experts * (2 * self.ffn_dim + self.dim) * self.expert_bias

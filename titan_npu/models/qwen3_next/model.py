"""The Qwen3-Next / Qwen3.5 model: the MoE decoder (models/moe_decoder's MoETransformer: routing statistics,
load-balancing loss, pipeline seams) whose blocks mix tokens by gated DeltaNet or gated attention (args.layer_types),
with zero-centred norms.

Every RMSNorm of the model (the blocks', the final one, q / k's) scales by 1 + weight and starts at weight 0
(transformers' Qwen3NextRMSNorm): weight decay pulls the scale towards 1, not 0.

Gated attention: q_proj gives each head a query and an output gate (interleaved per head: [query | gate]); q and k are
normalised per head, the first rotary_dim dims of each head rotated by RoPE in halves (transformers' rotate_half, no
row permutation needed on import), and the attention output times sigmoid(gate) goes into wo.

Gated DeltaNet (linear attention): q, k, v from their projections through a short causal depthwise convolution and
SiLU; beta = sigmoid(b), log decay g = -exp(A_log) softplus(a + dt_bias); the gated delta rule (ops/delta_rule.py,
q and k L2-normalised there); then an RMSNorm per value head times silu(z) (the gated norm, plain weight) and wo.
Packed documents restart both the convolution and the recurrent state at every boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.models.decoder.model import Attention, FeedForward, Linear, RMSNorm, TransformerBlock, precompute_rope
from titan_npu.models.init import ParamInit, constant, prefixed, trunc_normal
from titan_npu.models.moe.dispatch import all_reduce_grad
from titan_npu.models.moe_decoder.model import MoEBlock, MoETransformer
from titan_npu.models.qwen3_next.args import Qwen3NextArgs
from titan_npu.ops.delta_rule import gated_delta_rule
from titan_npu.ops.documents import Documents
from titan_npu.ops.short_conv import causal_conv1d_silu

# log A's distribution at initialisation: A spread over transformers' (0.01, 16), centred near 4.
A_LOG_INIT = trunc_normal(1.0, mean=1.386, low=0.0, high=2.773)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor-parallel parameter (the tensor itself when it is not split)."""
    return t.to_local() if isinstance(t, DTensor) else t


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose scale is 1 + weight (weight initialised to 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, 1.0 + self.weight.float(), self.eps)

    def param_inits(self) -> dict[str, ParamInit]:
        """A zero weight: unit scale."""
        return {"weight": constant(0.0)}


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with its first 2 x cos.shape[-1] dims rotated in halves (transformers' rotate_half), the rest
    passed through; cos / sin [S, r / 2] or [B, S, r / 2]."""
    half = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class GatedAttention(Attention):
    """Causal GQA attention with a sigmoid output gate per head and channel, q/k norms and partial RoPE."""

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__(args)
        self.wq = Linear(args.dim, 2 * args.q_dim)  # per head: [query | gate]
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos / sin: the RoPE tables of the rotated dims from position 0; documents: attention stops
        at their boundaries, RoPE takes their positions if any."""
        bs, seqlen, _ = x.shape
        if seqlen > cos.shape[0]:
            raise ConfigError(f"sequence length {seqlen} exceeds model.max_seq_len={cos.shape[0]}; "
                              f"raise model.max_seq_len or lower training.seq_len")
        xq, gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        xq = self.q_norm(xq)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        rows = slice(seqlen) if documents is None or documents.positions is None else documents.positions
        xq, xk = rotate_half(xq, cos[rows], sin[rows]), rotate_half(xk, cos[rows], sin[rows])
        out = ops.attention(xq, xk, xv, causal=True, use_flash=self.use_flash, documents=documents)
        out = out.reshape(bs, seqlen, -1) * torch.sigmoid(local(gate).reshape(bs, seqlen, -1))
        return self.wo(out)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """The decoder attention's, with the zero-centred norms' zero weights."""
        return {**super().param_inits(init_std), **prefixed("q_norm", self.q_norm.param_inits()),
                **prefixed("k_norm", self.k_norm.param_inits())}


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention: x [B, S, dim] -> [B, S, dim], the same call as the attention's."""

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__()
        d, key, value, heads = args.dim, args.linear_key_dim, args.linear_value_dim, args.linear_n_v_heads
        self.k_head_dim, self.v_head_dim = args.linear_k_head_dim, args.linear_v_head_dim
        self.eps = args.norm_eps
        self.in_q, self.in_k, self.in_v = Linear(d, key), Linear(d, key), Linear(d, value)
        self.in_z = Linear(d, value)  # the output gate
        self.in_b, self.in_a = Linear(d, heads), Linear(d, heads)  # write strength, decay step
        width = args.linear_conv_kernel
        self.conv_q, self.conv_k = nn.Parameter(torch.empty(key, width)), nn.Parameter(torch.empty(key, width))
        self.conv_v = nn.Parameter(torch.empty(value, width))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.norm_weight = nn.Parameter(torch.empty(args.linear_v_head_dim))
        self.out = Linear(value, d)
        # Set by tensor parallelism (parallelize.py): the group over which this rank's heads are a part, whose
        # gradients of the gated norm's weight (replicated, applied to every head) are partial and get summed.
        self.tp_group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos / sin unused (no positions in a linear layer); documents restart the state."""
        bs, seqlen, _ = x.shape
        segments = None if documents is None else documents.ids
        q, k, v = self.in_q(x), self.in_k(x), self.in_v(x)
        conv = causal_conv1d_silu(torch.cat((q, k, v), dim=-1),
                                  torch.cat([local(w) for w in (self.conv_q, self.conv_k, self.conv_v)]), segments)
        q, k, v = conv.split((q.shape[-1], k.shape[-1], v.shape[-1]), dim=-1)
        q, k = q.view(bs, seqlen, -1, self.k_head_dim), k.view(bs, seqlen, -1, self.k_head_dim)
        v = v.view(bs, seqlen, -1, self.v_head_dim)
        beta = torch.sigmoid(self.in_b(x))
        g = -local(self.A_log).float().exp() * F.softplus(self.in_a(x).float() + local(self.dt_bias))
        out = gated_delta_rule(q, k, v, g, beta, segments=segments,
                               cu_seqlens=None if documents is None else documents.cu_seqlens)
        out = self.gated_norm(out, self.in_z(x).view(bs, seqlen, -1, self.v_head_dim))
        return self.out(out.reshape(bs, seqlen, -1))

    def gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head of out, times its weight and silu(z) (transformers' Qwen3NextRMSNormGated)."""
        dtype = out.dtype
        weight = local(self.norm_weight)
        if self.tp_group is not None:
            weight = all_reduce_grad(weight, self.tp_group)
        h = out.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight * h.to(dtype) * F.silu(z.float())).to(dtype)

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Projections ~ N(0, 0.02), out ~ N(0, init_std); the convolution ~ N(0, K^-1/2); log A spread as
        A_LOG_INIT, dt_bias 1 and the gated norm's weight 1 (transformers' initialisation)."""
        width = self.conv_q.shape[1]
        inits = {f"{name}.weight": trunc_normal(0.02) for name in ("in_q", "in_k", "in_v", "in_z", "in_b", "in_a")}
        inits.update({name: trunc_normal(width**-0.5) for name in ("conv_q", "conv_k", "conv_v")})
        return {**inits, "A_log": A_LOG_INIT, "dt_bias": constant(1.0), "norm_weight": constant(1.0),
                "out.weight": trunc_normal(init_std)}


class HybridBlock(TransformerBlock):
    """A pre-norm layer: gated DeltaNet or gated attention, then a SwiGLU; zero-centred norms."""

    def __init__(self, layer_id: int, args: Qwen3NextArgs, feed_forward: nn.Module | None = None) -> None:
        mixer = GatedDeltaNet(args) if args.is_linear_layer(layer_id) else GatedAttention(args)
        super().__init__(layer_id, args, feed_forward=feed_forward or FeedForward(args.dim, args.ffn_dim),
                         attention=mixer)
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)


class HybridMoEBlock(MoEBlock, HybridBlock):
    """A hybrid layer whose feed-forward is the MoE layer (with its gated shared expert): returns (hidden states,
    RoutingStats); MoEBlock's forward, HybridBlock's mixer and norms."""


def build_block(layer_id: int, args: Qwen3NextArgs) -> nn.Module:
    """A hybrid MoE block for a MoE layer, the hybrid dense block otherwise."""
    return HybridMoEBlock(layer_id, args) if args.is_moe_layer(layer_id) else HybridBlock(layer_id, args)


class Qwen3NextTransformer(MoETransformer):
    """Qwen3-Next / Qwen3.5: the MoE decoder with hybrid blocks, a zero-centred final norm and partial RoPE tables;
    auxiliary_loss() and routing_metrics() as the MoE decoder's (nothing routed in a dense model)."""

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): build_block(i, args) for i in range(args.n_layers)})
        self.norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)

    def rope_tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [max_seq_len, rotary_dim / 2] fp32 of the rotated dims."""
        args = self.args
        return precompute_rope(args.rotary_dim, args.max_seq_len, args.rope_theta, None, device)

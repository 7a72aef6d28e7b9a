"""The gpt-oss model: the MoE decoder (models/moe_decoder's MoETransformer: routing statistics, load-balancing loss,
pipeline seams) with gpt-oss's attention in every block and YaRN RoPE tables.

Attention has biases on q/k/v/o and a learned logit per head (`sinks`) that joins each query's softmax and takes
probability mass without adding a value; sliding-window layers (args.layer_types) let a query see the last
sliding_window keys only. Both go through ops.attention's sink / window path (ops/reference.py: sink_attention).
RoPE rotates Meta's interleaved pairs, as the decoder does (the Hugging Face adapter permutes q/k rows), with YaRN's
frequencies and its magnitude factor on the cos / sin tables (transformers' yarn rope).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.models.decoder.model import Attention, Linear, TransformerBlock
from titan_npu.models.gpt_oss.args import GptOssArgs
from titan_npu.models.init import ParamInit, constant, trunc_normal
from titan_npu.models.moe.layer import MoE
from titan_npu.models.moe_decoder.model import MoEBlock, MoETransformer
from titan_npu.ops.documents import Documents


def yarn_rope(args: GptOssArgs, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim / 2] fp32: plain RoPE, or YaRN's blend of interpolated and extrapolated
    frequencies times its attention factor (transformers' _compute_yarn_parameters)."""
    dim, base = args.head_dim, args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if args.yarn_factor is not None:

        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.yarn_original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(args.yarn_beta_fast), correction_dim(args.yarn_beta_slow)
        if args.yarn_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low)
                / (high - low if high != low else 0.001)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv_freq = inv_freq / args.yarn_factor * (1 - extrapolate) + inv_freq * extrapolate
    factor = args.yarn_attention_factor()
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos() * factor, angles.sin() * factor


class SinkAttention(Attention):
    """Causal GQA attention with biases on q/k/v/o, a learned sink logit per head and, in a sliding layer, a window."""

    def __init__(self, layer_id: int, args: GptOssArgs) -> None:
        super().__init__(args)
        self.wo = Linear(args.q_dim, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.window = args.window(layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos/sin: the RoPE tables from position 0; documents: attention stops at their boundaries,
        RoPE takes their positions if any."""
        bs, seqlen, _ = x.shape
        if seqlen > cos.shape[0]:
            raise ConfigError(f"sequence length {seqlen} exceeds model.max_seq_len={cos.shape[0]}; "
                              f"raise model.max_seq_len or lower training.seq_len")
        rows = slice(seqlen) if documents is None or documents.positions is None else documents.positions
        xq, xk, xv = self.qkv(x, cos[rows], sin[rows])
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks  # this rank's heads' (TP)
        out = ops.attention(xq, xk, xv, causal=True, use_flash=self.use_flash, documents=documents, sinks=sinks,
                            window=self.window)
        return self.wo(out.reshape(bs, seqlen, -1))

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """The decoder attention's, the o-projection's bias 0 and the sinks ~ N(0, 0.02)."""
        return {**super().param_inits(init_std), "wo.bias": constant(0.0), "sinks": trunc_normal(0.02)}


class GptOssBlock(MoEBlock):
    """A pre-norm gpt-oss layer: sink attention, then the MoE feed-forward; returns (hidden states, RoutingStats)."""

    def __init__(self, layer_id: int, args: GptOssArgs) -> None:
        TransformerBlock.__init__(self, layer_id, args, feed_forward=MoE(args.moe_args()),
                                  attention=SinkAttention(layer_id, args))


class GptOssTransformer(MoETransformer):
    """gpt-oss: the MoE decoder with gpt-oss blocks and YaRN tables; auxiliary_loss() and routing_metrics() as the
    MoE decoder's."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): GptOssBlock(i, args) for i in range(args.n_layers)})

    def rope_tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The YaRN (or plain) RoPE tables of every position up to max_seq_len, fp32."""
        return yarn_rope(self.args, device)

"""The GLM-4.5 model: the MoE decoder (models/moe_decoder's MoETransformer: routing statistics, pipeline seams) whose
attention rotates only part of each head, with DeepSeek-V3's router in its MoE layers.

Attention is the decoder's (GQA, q/k/v biases, optional per-head q/k RMSNorm before the rotation, the context-parallel
and packed-document paths), except RoPE: the first rotary_dim dims of each q/k head are rotated in halves (transformers'
rotate_half: dim i pairs with i + rotary_dim / 2), the rest pass through. The weights keep Hugging Face's row order, so
they load unpermuted.

Every layer from first_k_dense on is MoE: sigmoid scores, the score-correction bias for the choice, shared experts
(models/moe). `score_biases()` are the routers' biases that aux-loss-free balancing moves after each optimizer step
(trainer/routing.py); the load-balancing loss is logged, never optimised (router_aux_loss_coef 0).
"""

from __future__ import annotations

import torch

from titan_npu.models.decoder.model import Attention, precompute_rope
from titan_npu.models.glm4_moe.args import Glm4MoeArgs
from titan_npu.models.moe_decoder.model import MoETransformer


def rotate_leading_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with its first r = 2 x cos.shape[-1] dims rotated as halves (i with i + r / 2), the rest
    unchanged; cos / sin [S, r / 2] (or [B, S, r / 2]: per-row positions) in fp32."""
    half = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    first, second, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin, rest), dim=-1)


class PartialRopeAttention(Attention):
    """The decoder's attention with RoPE on the leading rotary_dim dims of each head, in halves."""

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normalised per head if the model says so, then partly rotated) and v, each [B, S, heads, head_dim],
        of x [B, S, dim] at the positions whose cos/sin rows are given ([S, rotary_dim / 2])."""
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        return rotate_leading_halves(xq, cos, sin), rotate_leading_halves(xk, cos, sin), xv


class Glm4MoeTransformer(MoETransformer):
    """GLM-4.5; after each forward, routing_metrics() describes its routing and score_biases() are its routers'."""

    def __init__(self, args: Glm4MoeArgs) -> None:
        super().__init__(args)
        for layer in self.layers.values():
            layer.attention = PartialRopeAttention(args)

    def rope_tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [max_seq_len, rotary_dim / 2] fp32 of the rotated dims."""
        args = self.args
        return precompute_rope(args.rotary_dim, args.max_seq_len, args.rope_theta, None, device)

    def score_biases(self) -> dict[int, torch.Tensor]:
        """The score bias buffer of each MoE layer held, by its row of routing_metrics' expert_tokens."""
        return {self.moe_rows[layer_id]: layer.feed_forward.router.score_bias
                for layer_id, layer in self.layers.items() if layer_id in self.moe_rows and layer is not None}

"""The Qwen3-MoE model: the dense decoder (models/decoder) with MoE feed-forwards (models/moe) in its MoE layers.

Blocks, attention, norms, RoPE and the output are the decoder's. A MoE block returns its routing statistics beside
the hidden states; the model collects them over its layers in each forward and exposes, until the next forward,
`auxiliary_loss()` (router_aux_loss_coef x the load-balancing loss, the term the trainer adds to the optimised
loss) and `routing_metrics()` (what the trainer logs). A pipeline stage pools the layers it holds.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_npu.models.decoder.model import Transformer, TransformerBlock
from titan_npu.models.moe.balance import load_balancing_loss
from titan_npu.models.moe.layer import MoE, RoutingStats
from titan_npu.models.qwen3_moe.args import MoEDecoderArgs


class MoEBlock(TransformerBlock):
    """A pre-norm layer whose feed-forward is a MoE layer: returns (hidden states, RoutingStats)."""

    def __init__(self, layer_id: int, args: MoEDecoderArgs) -> None:
        super().__init__(layer_id, args, feed_forward=MoE(args.moe_args()))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, RoutingStats]:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        out, routing = self.feed_forward(self.ffn_norm(h))
        return h + out, routing


def build_block(layer_id: int, args: MoEDecoderArgs) -> nn.Module:
    """A MoE block for a MoE layer, the dense block otherwise."""
    return MoEBlock(layer_id, args) if args.is_moe_layer(layer_id) else TransformerBlock(layer_id, args)


class MoETransformer(Transformer):
    """The decoder with MoE layers; after each forward, auxiliary_loss() and routing_metrics() describe it."""

    def __init__(self, args: MoEDecoderArgs) -> None:
        super().__init__(args, block=build_block)
        self.routing: list[RoutingStats] = []
        self.routed_rows = 0
        # Set by context parallelism (parallel/context_parallel.py): the cp ranks hold the other positions of these
        # sequences, and the load-balancing loss pools the expert counts over them. None: every position is here.
        self.context = None

    def run_layers(self, h: torch.Tensor) -> torch.Tensor:
        """The blocks in order, keeping each MoE block's routing statistics of this forward."""
        routing = []
        for layer in self.layers.values():
            if layer is None:
                continue
            out = layer(h, self.freqs_cos, self.freqs_sin)
            if isinstance(out, tuple):
                h, stats = out
                routing.append(stats)
            else:
                h = out
        self.routing, self.routed_rows = routing, h.shape[:-1].numel()
        return h

    def load_balancing_loss(self) -> torch.Tensor | None:
        """transformers' Qwen3-MoE aux_loss of the last forward (pooled over the MoE layers held), or None when it
        held none."""
        if not self.routing:
            return None
        counts = [r[0] for r in self.routing]
        if self.context is not None:
            # Context parallel: f over every cp rank's tokens (the counts summed, / cp for the local row count),
            # P over this rank's. The cp ranks' mean of n_experts x sum_e f_e P_e is then the loss of the whole
            # sequences, and so is the gradient the data-parallel average over the cp ranks takes (the cross
            # entropy's cp weighting likewise: context_parallel.py).
            pooled = self.context.token_sum(torch.stack(counts)) / self.context.size
            counts = list(pooled.unbind(0))
        return load_balancing_loss(counts, [r[1] for r in self.routing], self.routed_rows)

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The term the last forward adds to the optimised loss (router_aux_loss_coef x the load-balancing loss);
        None when the coefficient is 0 or no MoE layer ran."""
        coef = self.args.router_aux_loss_coef
        loss = self.load_balancing_loss() if coef > 0 else None
        return None if loss is None else coef * loss

    @torch.no_grad()
    def routing_metrics(self) -> dict[str, torch.Tensor]:
        """Device tensors of the last forward, detached: aux_loss (the unweighted load-balancing loss),
        expert_tokens [MoE layers, n_experts] (assignments per expert) and, with a capacity factor, dropped_tokens
        (over all layers)."""
        if not self.routing:
            return {}
        metrics = {"aux_loss": self.load_balancing_loss().detach(),
                   "expert_tokens": torch.stack([r[0] for r in self.routing])}
        if self.args.capacity_factor is not None:
            metrics["dropped_tokens"] = torch.stack([r[2] for r in self.routing]).sum()
        return metrics

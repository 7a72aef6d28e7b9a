"""The MoE decoder: the dense decoder (models/decoder) with MoE feed-forwards (models/moe) in its MoE layers.

Blocks, attention, norms, RoPE and the output are the decoder's. A MoE block returns its routing statistics beside
the hidden states; the model collects them over its layers in each forward and exposes, until the next forward,
`auxiliary_loss()` (router_aux_loss_coef x the load-balancing loss, the term the trainer adds to the optimised
loss) and `routing_metrics()` (what the trainer logs). A pipeline stage pools the layers it holds.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_npu.models.decoder.model import Transformer, TransformerBlock
from titan_npu.models.moe.balance import pooled_load_balancing_loss
from titan_npu.models.moe.layer import MoE, RoutingStats
from titan_npu.models.moe_decoder.args import MoEDecoderArgs
from titan_npu.ops.documents import Documents


class MoEBlock(TransformerBlock):
    """A pre-norm layer whose feed-forward is a MoE layer: returns (hidden states, RoutingStats)."""

    def __init__(self, layer_id: int, args: MoEDecoderArgs) -> None:
        super().__init__(layer_id, args, feed_forward=MoE(args.moe_args()))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None
                ) -> tuple[torch.Tensor, RoutingStats]:
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
        out, routing = self.feed_forward(self.ffn_norm(h))
        return h + out, routing


def build_block(layer_id: int, args: MoEDecoderArgs) -> nn.Module:
    """A MoE block for a MoE layer, the dense block otherwise."""
    return MoEBlock(layer_id, args) if args.is_moe_layer(layer_id) else TransformerBlock(layer_id, args)


class MoETransformer(Transformer):
    """The decoder with MoE layers; after each forward, auxiliary_loss() and routing_metrics() describe it.

    A pipeline stage (parallel/pipeline.py) pools what the stages before it routed: every stage but the last returns
    (hidden states, counts, probability sums) with the running sums over the MoE layers so far (assignments per
    expert, int64 so that no cast rounds them; router probabilities summed over the tokens, fp32, with their
    gradient), every stage but the first takes them as inputs after the hidden states. The last stage so holds the
    pooled sums of every MoE layer of the model, its load-balancing loss is the whole model's, and autograd carries
    the loss's gradient back through the probability sums to every earlier stage's routers in that micro-batch's
    backward (the counts are detached: the loss's gradient flows through the probabilities only).
    """

    def __init__(self, args: MoEDecoderArgs) -> None:
        super().__init__(args, block=build_block)
        self.routing: list[RoutingStats] = []
        self.routed_rows = 0
        # Row of each MoE layer in expert_tokens (global over the model, so that pipeline stages line up).
        self.moe_rows = {str(i): n for n, i in enumerate(j for j in range(args.n_layers) if args.is_moe_layer(j))}
        self.routing_rows: list[int] = []
        self.carried: tuple[torch.Tensor, torch.Tensor] | None = None  # the sums of the stages before this one
        # Sequence shards of the hidden states between blocks (tensor parallelism's sequence parallelism): the MoE
        # layers route the whole gathered sequence, this many times the rows a rank's hidden states hold.
        self.sequence_shards = 1
        # Set by context parallelism (parallel/context_parallel.py): the cp ranks hold the other positions of these
        # sequences, and the load-balancing loss pools the expert counts over them. None: every position is here.
        self.context = None

    def forward(self, tokens: torch.Tensor, *carried: torch.Tensor, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 0, documents: Documents | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder's forward; a pipeline stage also takes and (but the last) returns the routing sums."""
        self.carried = (carried[0], carried[1]) if carried else None
        out = super().forward(tokens, labels=labels, loss_chunk_tokens=loss_chunk_tokens, documents=documents)
        if self.output is not None:
            return out
        counts, prob_sums = self.routing_sums()
        return out, counts, prob_sums

    def run_layers(self, h: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The blocks in order, keeping each MoE block's routing statistics of this forward."""
        routing, rows = [], []
        for name, layer in self.layers.items():
            if layer is None:
                continue
            out = layer(h, self.freqs_cos, self.freqs_sin, documents=documents)
            if isinstance(out, tuple):
                h, stats = out
                routing.append(stats)
                rows.append(self.moe_rows[name])
            else:
                h = out
        self.routing, self.routing_rows = routing, rows
        self.routed_rows = h.shape[:-1].numel() * self.sequence_shards
        return h

    def routing_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(assignments per expert int64, router probabilities summed fp32) over the MoE layers of the last forward
        and those the earlier pipeline stages carried in."""
        n_experts = self.args.n_experts
        device = self.freqs_cos.device
        counts = torch.zeros(n_experts, dtype=torch.int64, device=device)
        prob_sums = torch.zeros(n_experts, dtype=torch.float32, device=device)
        if self.carried is not None:
            counts, prob_sums = self.carried[0], self.carried[1].float()
        for layer_counts, layer_probs, _ in self.routing:
            counts = counts + layer_counts.long()
            prob_sums = prob_sums + layer_probs
        return counts, prob_sums

    def load_balancing_loss(self) -> torch.Tensor | None:
        """transformers' Qwen3-MoE aux_loss of the last forward (pooled over the MoE layers held and, in a pipeline
        stage, those the earlier stages carried in), or None when there were none."""
        if not self.routing and self.carried is None:
            return None
        layers = len(self.routing) if self.carried is None else self.args.n_moe_layers
        counts, prob_sums = self.routing_sums()
        if self.context is not None:
            # Context parallel: f over every cp rank's tokens (the counts summed, / cp for the local row count),
            # P over this rank's. The cp ranks' mean of n_experts x sum_e f_e P_e is then the loss of the whole
            # sequences, and so is the gradient the data-parallel average over the cp ranks takes (the cross
            # entropy's cp weighting likewise: context_parallel.py).
            counts = self.context.token_sum(counts.float()) / self.context.size
        return pooled_load_balancing_loss(counts, prob_sums, self.routed_rows * layers)

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The term the last forward adds to the optimised loss (router_aux_loss_coef x the load-balancing loss);
        None when the coefficient is 0 or no MoE layer ran."""
        coef = self.args.router_aux_loss_coef
        loss = self.load_balancing_loss() if coef > 0 and self.output is not None else None
        return None if loss is None else coef * loss

    @torch.no_grad()
    def routing_metrics(self) -> dict[str, torch.Tensor]:
        """Device tensors of the last forward, detached: aux_loss (the unweighted load-balancing loss; on the model's
        output part only, which pools every MoE layer), expert_tokens [model's MoE layers, n_experts] (assignments
        per expert; zero rows for the layers of other pipeline stages) and, with a capacity factor, dropped_tokens
        (over the layers held)."""
        if not self.args.n_moe_layers:
            return {}
        device = self.freqs_cos.device
        held = [r[0] for r in self.routing]
        if len(held) == self.args.n_moe_layers:  # every MoE layer (no pipeline split)
            tokens = torch.stack(held)
        else:
            tokens = torch.zeros(self.args.n_moe_layers, self.args.n_experts, device=device)
            for row, layer_tokens in zip(self.routing_rows, held):
                tokens[row] = layer_tokens
        metrics = {"expert_tokens": tokens}
        aux = self.load_balancing_loss() if self.output is not None else None
        if aux is not None:
            metrics["aux_loss"] = aux.detach()
        if self.args.capacity_factor is not None:
            metrics["dropped_tokens"] = sum((r[2] for r in self.routing),
                                            torch.zeros((), dtype=torch.int64, device=device))
        return metrics

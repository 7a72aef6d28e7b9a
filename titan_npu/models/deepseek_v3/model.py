"""The DeepSeek-V3 model: the decoder's shell (models/decoder: embedding, pre-norm blocks, final norm, output, the
weight init and pipeline seams) with multi-head latent attention in every block and, from layer first_k_dense
on, MoE feed-forwards (models/moe) routed by the group-limited sigmoid router.

Multi-head latent attention (MLA): the query is x W_q, or through a low-rank path W_q_b norm(W_q_a x) when
q_lora_rank > 0; keys and values come from one compressed latent c = norm(W_kv_a x)[:kv_lora_rank] expanded per
head by W_kv_b into a no-RoPE key part and the value, while the RoPE key part (qk_rope_head_dim wide) is computed
once from x and shared by every head. RoPE acts on Meta's interleaved pairs (DeepSeek's layout: transformers'
rope_interleave), so the published weights load unpermuted; YaRN stretches its frequencies as the published
config does and scales the softmax by mscale^2.

As the MoE decoder (moe_decoder) does, a MoE block returns its routing statistics beside the hidden states and the model
exposes, after each forward, `auxiliary_loss()` (seq_aux_loss_coef x the sequence-wise balance loss summed over the
MoE layers, when the coefficient is set) and `routing_metrics()` (trainer/routing.py); `score_biases()` are the
routers' biases that aux-loss-free balancing moves after each optimizer step (trainer/routing.py,
update_score_biases).

Multi-token prediction (mtp_depth > 0): module k (held as layers.{n_layers + k - 1}, the Hugging Face checkpoint's
index) combines the previous depth's hidden states at position i with the embedding of token i + k, runs one MoE
block and predicts token i + k + 1 through its own norm and the model's output head; a forward given labels adds
mtp_loss_coef x the modules' mean cross entropy to auxiliary_loss() and logs it as mtp_loss. Their routers' loads
follow the main layers' in routing_metrics' expert_tokens, so their biases move like the others.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.models.decoder.model import Linear, RMSNorm, Transformer, TransformerBlock
from titan_npu.models.deepseek_v3.args import DeepSeekArgs, yarn_mscale
from titan_npu.models.init import ParamInit, prefixed, trunc_normal
from titan_npu.models.moe.balance import load_balancing_loss
from titan_npu.models.moe.group_router import sequence_balance_loss
from titan_npu.models.moe.layer import MoE, RoutingStats
from titan_npu.ops.cross_entropy import chunked_linear_cross_entropy
from titan_npu.ops.documents import Documents

# The low-rank paths' norms have a fixed eps, whatever model.norm_eps (as the published model has them).
LORA_NORM_EPS = 1e-6


def yarn_rope(args: DeepSeekArgs, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, qk_rope_head_dim / 2] fp32 of the RoPE key/query parts: plain RoPE, or YaRN's
    blend of interpolated and extrapolated frequencies times its attention factor (transformers' yarn rope)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    factor = 1.0
    if args.yarn_factor is not None:
        factor = args.yarn_factor

        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.yarn_original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(args.yarn_beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.yarn_beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low)
                / (high - low if high != low else 0.001)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    if args.yarn_mscale and args.yarn_mscale_all_dim:
        attention_factor = yarn_mscale(factor, args.yarn_mscale) / yarn_mscale(factor, args.yarn_mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor, 1.0)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group (a tensor every tensor-parallel rank
    computes whole but each rank's heads use only in part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class MLA(nn.Module):
    """Multi-head latent attention, causal; x [B, S, dim] -> [B, S, dim]."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.head_dim = args.head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.use_flash = args.use_flash_attention
        if args.q_lora_rank:
            self.wq_a = Linear(args.dim, args.q_lora_rank)
            self.q_norm = RMSNorm(args.q_lora_rank, LORA_NORM_EPS)
            self.wq_b = Linear(args.q_lora_rank, args.n_heads * args.head_dim)
        else:
            self.wq = Linear(args.dim, args.n_heads * args.head_dim)
        self.wkv_a = Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LORA_NORM_EPS)
        self.wkv_b = Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim))
        self.wo = Linear(args.n_heads * args.v_head_dim, args.dim)
        # The attention kernels scale by head_dim^-0.5; YaRN's extra factor goes onto the queries.
        self.q_scale = args.softmax_scale * args.head_dim ** 0.5
        # Set by tensor parallelism: the group whose ranks hold the other heads (the shared RoPE key's gradient is
        # summed over it). None: every head is here.
        self.tp_group = None
        # Set by context parallelism (parallel/context_parallel.py's RingContext or UlyssesContext, as for the dense
        # decoder's Attention): this rank holds the load-balanced chunks of each sequence. None: every position.
        self.context = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos/sin: the RoPE tables from position 0 with at least S rows; documents
        (data.document_mask): attention stops at their boundaries, RoPE takes their positions if any."""
        bs, seqlen, _ = x.shape
        whole = seqlen if self.context is None else seqlen * self.context.size
        if whole > cos.shape[0]:
            raise ConfigError(f"sequence length {whole} exceeds model.max_seq_len={cos.shape[0]}; "
                              f"raise model.max_seq_len or lower training.seq_len")
        # The RoPE (YaRN) rows of the positions held: the first S (or the positions inside the documents), or the
        # chunks' true positions (inside their documents) under CP.
        if self.context is not None:
            rows = self.context.positions(seqlen, x.device, documents)
        else:
            rows = slice(seqlen) if documents is None or documents.positions is None else documents.positions
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bs, seqlen, -1, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.tp_group is not None:
            k_rope = _SumGradOver.apply(k_rope, self.tp_group)
        q_rope, k_rope = ops.apply_rotary_emb(q_rope, k_rope.unsqueeze(2), cos[rows], sin[rows])
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        # Kernels take one head width for q, k and v (npu_fusion_attention among them): the value is zero-padded to it
        # and the padding cut off after, as MindSpeed-LLM does for MLA (its multi_latent_attention.py).
        pad = self.head_dim - self.v_dim
        v = F.pad(v, (0, pad)) if pad > 0 else v
        if self.context is None:
            out = ops.attention(q, k, v, causal=True, use_flash=self.use_flash, documents=documents)
        elif documents is None:  # across the cp ranks, through the seam the dense decoder's attention uses
            out = self.context.attention(q, k, v)
        else:
            out = self.context.attention(q, k, v, documents)
        if pad > 0:
            out = out[..., :self.v_dim]
        return self.wo(out.reshape(bs, seqlen, -1))

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Projections ~ N(0, 0.02), the output projection (into the residual stream) ~ N(0, init_std), the
        low-rank norms a unit scale."""
        names = ["wq_a", "wq_b"] if hasattr(self, "wq_a") else ["wq"]
        inits = {f"{name}.weight": trunc_normal(0.02) for name in (*names, "wkv_a", "wkv_b")}
        if hasattr(self, "q_norm"):
            inits.update(prefixed("q_norm", self.q_norm.param_inits()))
        return {**inits, **prefixed("kv_norm", self.kv_norm.param_inits()), "wo.weight": trunc_normal(init_std)}


class DeepSeekBlock(TransformerBlock):
    """A pre-norm layer with MLA; a MoE layer's forward returns (hidden states, RoutingStats, its sequence-wise
    balance loss or None), a dense one's the hidden states."""

    def __init__(self, layer_id: int, args: DeepSeekArgs) -> None:
        moe = args.is_moe_layer(layer_id)
        super().__init__(layer_id, args, feed_forward=MoE(args.moe_args()) if moe else None, attention=MLA(args))
        self.is_moe = moe
        self.seq_aux = moe and args.seq_aux_loss_coef > 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, RoutingStats, torch.Tensor | None]:
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
        if not self.is_moe:
            return h + self.feed_forward(self.ffn_norm(h))
        normed = self.ffn_norm(h)
        out, routing = self.feed_forward(normed)
        balance = None
        if self.seq_aux:  # the router again on the same input: its choices per token, grouped by sequence
            _, experts, scores = self.feed_forward.router(normed.reshape(-1, normed.shape[-1]))
            balance = sequence_balance_loss(experts, scores, normed.shape[0], self.attention.context)
        return h + out, routing, balance


class MTPBlock(DeepSeekBlock):
    """One multi-token prediction depth: (hidden states [B, S, dim], embeddings of the tokens one further
    [B, S, dim]) -> (its hidden states: eh_proj([enorm(embedding); hnorm(hidden)]) through a MoE block, those
    through head_norm, the input of the shared output head, and the MoE block's RoutingStats)."""

    def __init__(self, layer_id: int, args: DeepSeekArgs) -> None:
        super().__init__(layer_id, args)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = Linear(2 * args.dim, args.dim)
        self.head_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, embedding: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, RoutingStats]:
        x = self.eh_proj(torch.cat([self.enorm(embedding), self.hnorm(h)], dim=-1))
        out, routing, _ = super().forward(x, cos, sin)
        return out, self.head_norm(out), routing

    def param_inits(self) -> dict[str, ParamInit]:
        """The block's, the input norms and the output norm a unit scale, the projection ~ N(0, 0.02)."""
        return {**super().param_inits(), **prefixed("enorm", self.enorm.param_inits()),
                **prefixed("hnorm", self.hnorm.param_inits()), "eh_proj.weight": trunc_normal(0.02),
                **prefixed("head_norm", self.head_norm.param_inits())}


class DeepSeekTransformer(Transformer):
    """DeepSeek-V3; after each forward, auxiliary_loss() and routing_metrics() describe its routing."""

    def __init__(self, args: DeepSeekArgs) -> None:
        super().__init__(args, block=DeepSeekBlock)
        for depth in range(args.mtp_depth):
            self.layers[str(args.n_layers + depth)] = MTPBlock(args.n_layers + depth, args)
        self.routing: list[RoutingStats] = []
        self.balance: list[torch.Tensor] = []
        self.mtp_losses: list[torch.Tensor] = []
        self.routed_rows: torch.Tensor | int = 0
        # Row of each MoE layer (not the multi-token prediction modules') in expert_tokens: global over the model,
        # so that pipeline stages line up.
        self.moe_rows = {str(i): n for n, i in enumerate(j for j in range(args.n_layers) if args.is_moe_layer(j))}
        # The multi-token prediction modules' rows follow (their routing of the last forward in mtp_routing).
        self.mtp_rows = {str(args.n_layers + d): len(self.moe_rows) + d for d in range(args.mtp_depth)}
        self.mtp_routing: list[RoutingStats] = []
        # Set by context parallelism: the cp ranks hold the other positions of these sequences; the logged aux_loss
        # pools the expert counts over them. None: every position is here.
        self.context = None

    def rope_tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE (or YaRN) tables of the rotated query/key parts."""
        return yarn_rope(self.args, device)

    def run_layers(self, h: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The blocks in order, keeping each MoE block's routing statistics of this forward."""
        routing, balance = [], []
        for layer_id, layer in self.layers.items():
            if layer is None or int(layer_id) >= self.args.n_layers:  # multi-token prediction runs in forward
                continue
            out = layer(h, self.freqs_cos, self.freqs_sin, documents=documents)
            if isinstance(out, tuple):
                h, stats, seq_loss = out
                routing.append(stats)
                if seq_loss is not None:
                    balance.append(seq_loss)
            else:
                h = out
        # Rows routed per MoE layer: the tokens here, or under tensor parallelism the whole sequence each rank
        # routes (its assignments over top_k).
        rows = routing[0][0].sum() / self.args.top_k if routing else h.shape[:-1].numel()
        self.routing, self.balance, self.routed_rows = routing, balance, rows
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 0, documents: Documents | None = None) -> torch.Tensor:
        """The decoder's forward; with labels and multi-token prediction modules, each module's cross entropy is
        kept for auxiliary_loss (module k sees the first S - k positions, its targets labels shifted by k).
        documents: the batch's packed documents (data.document_mask; refused with multi-token prediction)."""
        self.mtp_losses, self.mtp_routing = [], []
        if not self.args.mtp_depth or labels is None:
            return super().forward(tokens, labels, loss_chunk_tokens, documents)
        h = self.run_layers(self.tok_embeddings(tokens))
        loss = chunked_linear_cross_entropy(self.norm(h), self.output.weight, labels, loss_chunk_tokens)
        seqlen = tokens.shape[1]
        for depth in range(1, min(self.args.mtp_depth, seqlen - 1) + 1):
            block = self.layers[str(self.args.n_layers + depth - 1)]
            # Token i + depth is labels[i + depth - 1]; ignored labels (negative) embed as token 0.
            embedding = self.tok_embeddings(labels[:, depth - 1:seqlen - 1].clamp(min=0))
            h, normed, routing = block(h[:, :seqlen - depth], embedding, self.freqs_cos, self.freqs_sin)
            self.mtp_routing.append(routing)
            self.mtp_losses.append(chunked_linear_cross_entropy(normed, self.output.weight, labels[:, depth:],
                                                                loss_chunk_tokens))
        return loss

    def mtp_loss(self) -> torch.Tensor | None:
        """The mean cross entropy of the multi-token prediction modules in the last forward (None: none ran)."""
        return torch.stack(self.mtp_losses).mean() if self.mtp_losses else None

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The term the last forward adds to the optimised loss: seq_aux_loss_coef x the sequence-wise balance
        loss summed over the MoE layers held, plus mtp_loss_coef x the multi-token prediction loss; None when
        neither is on (balance then comes from the score bias alone)."""
        terms = []
        if self.balance:
            terms.append(self.args.seq_aux_loss_coef * torch.stack(self.balance).sum())
        if self.mtp_losses:
            terms.append(self.args.mtp_loss_coef * self.mtp_loss())
        return sum(terms[1:], terms[0]) if terms else None

    def score_biases(self) -> dict[int, torch.Tensor]:
        """The score bias buffer of each MoE layer held, by its row of routing_metrics' expert_tokens."""
        rows = {**self.moe_rows, **self.mtp_rows}
        return {rows[layer_id]: layer.feed_forward.router.score_bias
                for layer_id, layer in self.layers.items() if layer_id in rows and layer is not None}

    @torch.no_grad()
    def routing_metrics(self) -> dict[str, torch.Tensor]:
        """Device tensors of the last forward, detached: expert_tokens [the model's MoE layers, then its multi-token
        prediction modules, n_experts] (zero rows for the layers of other pipeline stages and modules that did not
        run), aux_loss (on the output part: the pooled load-balancing loss of
        the sigmoid scores of the MoE layers held, a diagnostic) and, with multi-token prediction, mtp_loss."""
        if not self.moe_rows and not self.mtp_rows:
            return {}
        held = [r[0] for r in self.routing]
        if held and len(held) == len(self.moe_rows):  # every MoE layer (no pipeline split)
            tokens = torch.stack(held)
        else:  # a pipeline stage: its layers' rows (none for a stage of dense layers only, which still reports)
            tokens = torch.zeros(len(self.moe_rows), self.args.n_experts, device=self.freqs_cos.device)
            rows = [self.moe_rows[layer_id] for layer_id, layer in self.layers.items()
                    if layer_id in self.moe_rows and layer is not None]
            for row, layer_tokens in zip(rows, held, strict=True):
                tokens[row] = layer_tokens
        if self.mtp_rows:
            mtp = tokens.new_zeros(len(self.mtp_rows), tokens.shape[-1])
            for row, stats in enumerate(self.mtp_routing):
                mtp[row] = stats[0]
            tokens = torch.cat([tokens, mtp])
        metrics = {"expert_tokens": tokens}
        if self.output is not None and held:
            counts = held
            if self.context is not None:  # f over the whole sequences (the cp ranks' mean of the loss: qwen3_moe's)
                counts = [self.context.token_sum(c.float()) / self.context.size for c in held]
            metrics["aux_loss"] = load_balancing_loss(counts, [r[1] for r in self.routing], self.routed_rows).detach()
        if self.mtp_losses:
            metrics["mtp_loss"] = self.mtp_loss().detach()
        return metrics

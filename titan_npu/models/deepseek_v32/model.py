"""DeepSeek-V3.2: DeepSeek-V3 (models/deepseek_v3: MLA, the MoE layers, YaRN) whose attention keeps, for each query,
only the keys its lightning indexer ranks highest: DeepSeek Sparse Attention (DSA), as transformers'
DeepseekV32ForCausalLM computes it.

The lightning indexer of a layer, on the block's normed input x [B, S, dim] and MLA's query latent
c_q = norm(W_q_a x) [B, S, q_lora_rank]:
  q_I = W_I_q c_q, H_I heads of D_I;  k_I = LayerNorm(W_I_k x), one head of D_I;  w = W_I_w x [B, S, H_I]
  RoPE on the first qk_rope_head_dim channels of q_I and k_I, in half-split pairs (i, i + r/2), unlike MLA's
  interleaved ones; I[s, t] = sum_h w[s, h] H_I^-0.5 ReLU(D_I^-0.5 q_I[s, h] . k_I[t]), in fp32.
The attention of query s then runs over its top index_topk keys by I among the keys it may see (causal, and inside
its document with data.document_mask); a query with fewer visible keys keeps them all (the published definition:
top-min(index_topk, S) of the masked scores). The selection and that attention are the ops indexer_topk and
sparse_attention (titan_npu/ops: the plain torch reference on CPU/CUDA, torch_npu's kernels on Ascend). GLM-5
(model.variant = "glm_moe_dsa", transformers' GlmMoeDsaForCausalLM) rotates the indexer's pairs interleaved, and a
layer its indexer_types marks "shared" has no indexer: it attends over the keys the last full layer selected in the
same forward.

Training (model.dsa_stage, models/deepseek_v32/args.py): the indexer reads x and c_q detached, so only its KL loss
trains it; the loss of layer l is the mean over the queries s of KL(p_s || softmax(I_s)) over the keys of the
stage (every visible key in the dense warm-up, the selected ones in the sparse stage), p_s the main attention's
probabilities summed over heads and L1-normalised (a target without gradient); auxiliary_loss() adds
indexer_loss_weight x the sum over layers to DeepSeek-V3's terms. The target is one more eager pass of the
attention scores, [B, H, S, S] fp32, per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.models.decoder.model import Linear
from titan_npu.models.deepseek_v3.model import MLA, DeepSeekTransformer
from titan_npu.models.deepseek_v32.args import DENSE_WARMUP, DSAArgs
from titan_npu.models.init import ParamInit, constant, trunc_normal
from titan_npu.ops import reference
from titan_npu.ops.documents import Documents

INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm (transformers' DeepseekV32Indexer)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first 2 r channels of x [B, S, ..., D] in half-split pairs (i, i + r); cos/sin [S, r] (or
    [B, S, r])."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    while cos.dim() < x1.dim():  # the head dims between the sequence and the channels
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def deinterleave(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [..., D] with its first rope_dim channels reordered from pairs (2i, 2i + 1) to halves (i, i + rope_dim / 2):
    half-split RoPE on the result rotates the original pairs (dot products between equally reordered vectors are
    unchanged)."""
    rope = x[..., :rope_dim].unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat([rope, x[..., rope_dim:]], dim=-1)


class LightningIndexer(nn.Module):
    """DSA's lightning indexer: (x, the query latent, RoPE tables) -> its query heads, key and head weights."""

    def __init__(self, args: DSAArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
        self.interleaved = args.indexer_rope_interleave
        self.wq_b = Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim)
        self.wk = Linear(args.dim, args.index_head_dim)
        self.k_norm = nn.LayerNorm(args.index_head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = Linear(args.dim, args.index_n_heads)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [B, S, H, D], k [B, S, D], w [B, S, H] fp32) after RoPE: the operands of
        I[b, s, t] = sum_h w[b, s, h] ReLU(D^-0.5 q[b, s, h] . k[b, t]) (ops.indexer_topk, reference.indexer_scores);
        cos/sin the rows of the positions held ([S, rope / 2])."""
        bs, seqlen, _ = x.shape
        q = self.wq_b(q_latent).view(bs, seqlen, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        if self.interleaved:  # GLM-5: pairs (2i, 2i + 1), gathered into halves first as transformers does
            q, k = deinterleave(q, self.rope_dim), deinterleave(k, self.rope_dim)
        q, k = rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin)
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5  # fp32, as published
        return q, k, weights

    def param_inits(self) -> dict[str, ParamInit]:
        """Projections ~ N(0, 0.02), the key norm a unit scale and no shift."""
        return {"wq_b.weight": trunc_normal(0.02), "wk.weight": trunc_normal(0.02),
                "weights_proj.weight": trunc_normal(0.02), "k_norm.weight": constant(1.0),
                "k_norm.bias": constant(0.0)}


class SparseMLA(MLA):
    """MLA whose queries attend to the keys their lightning indexer selects (a layer without an indexer: those its
    source layer's selected in this forward, kept in `selections`, a dict the model's layers share); after a
    training forward whose indexer learns, `indexer_loss` holds this layer's KL loss."""

    def __init__(self, args: DSAArgs, layer_id: int, selections: dict[int, torch.Tensor]) -> None:
        super().__init__(args)
        self.indexer = LightningIndexer(args) if args.has_indexer(layer_id) else None
        self.layer_id, self.source = layer_id, args.selection_source(layer_id)
        self.selections = selections
        self.topk = args.index_topk
        self.dense = args.dsa_stage == DENSE_WARMUP
        self.learns = args.trains_indexer
        self.indexer_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos/sin: the RoPE tables from position 0; documents (data.document_mask): keys outside a
        query's document are never visible to it, RoPE takes their positions."""
        bs, seqlen, _ = x.shape
        if seqlen > cos.shape[0]:
            raise ConfigError(f"sequence length {seqlen} exceeds model.max_seq_len={cos.shape[0]}; raise "
                              f"model.max_seq_len or lower training.seq_len")
        rows = slice(seqlen) if documents is None or documents.positions is None else documents.positions
        cos, sin = cos[rows], sin[rows]
        q_latent = self.q_norm(self.wq_a(x))
        q_nope, q_rope = self.wq_b(q_latent).view(bs, seqlen, -1, self.head_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope, k_rope = ops.apply_rotary_emb(q_rope, k_rope.unsqueeze(2), cos, sin)
        k_nope, v = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        visible = reference.visible_keys(bs, seqlen, x.device, documents)
        learning = self.training and self.learns and self.indexer is not None
        indices = scores = None
        if self.indexer is None:  # the source layer's selection of this forward
            indices = None if self.dense else self.selections[self.source]
        elif learning or not self.dense:
            # Detached: the language-model loss does not reach the indexer, nor its loss the model.
            with torch.set_grad_enabled(learning and torch.is_grad_enabled()):
                q_index, k_index, weights = self.indexer(x.detach(), q_latent.detach(), cos, sin)
                scores = reference.indexer_scores(q_index, k_index, weights) if learning and not self.dense else None
            if not self.dense:  # the scores at hand rank the keys; without them, the indexer kernel does
                indices = (reference.top_keys(scores.detach(), visible, self.topk) if learning else ops.indexer_topk(
                    q_index.detach(), k_index.detach(), weights.detach(), self.topk, documents))
                self.selections[self.layer_id] = indices
        pad = self.head_dim - self.v_dim
        v = F.pad(v, (0, pad)) if pad > 0 else v
        if self.dense:
            out = ops.attention(q, k, v, causal=True, use_flash=self.use_flash, documents=documents)
        else:
            out = ops.sparse_attention(q, k, v, indices, use_flash=self.use_flash)
        if not learning:
            self.indexer_loss = None
        elif self.dense:
            self.indexer_loss = ops.indexer_warmup_loss(q, k, q_index, k_index, weights, self.rope_dim, documents)
        else:
            keys = reference.selected_mask(indices, seqlen)
            self.indexer_loss = reference.indexer_kl(reference.head_summed_probs(q, k, keys), scores, keys)
        if pad > 0:
            out = out[..., :self.v_dim]
        return self.wo(out.reshape(bs, seqlen, -1))

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """MLA's, and the indexer's under `indexer.`."""
        own = {} if self.indexer is None else self.indexer.param_inits()
        return {**super().param_inits(init_std), **{f"indexer.{k}": v for k, v in own.items()}}


class DSATransformer(DeepSeekTransformer):
    """DeepSeek-V3.2: DeepSeek-V3 with SparseMLA in every layer; the dense warm-up freezes all but the indexers,
    indexer_loss_weight 0 freezes the indexers."""

    def __init__(self, args: DSAArgs) -> None:
        super().__init__(args)
        # Each indexer's selection of the current forward, by layer, for the layers that reuse it (GLM-5).
        self.selections: dict[int, torch.Tensor] = {}
        for layer_id, layer in self.layers.items():
            layer.attention = SparseMLA(args, int(layer_id), self.selections)
        for name, param in self.named_parameters():
            param.requires_grad_(args.trains(name))

    def indexer_loss(self) -> torch.Tensor | None:
        """The sum over the layers held of their indexers' KL losses in the last forward (None: none learned)."""
        losses = [layer.attention.indexer_loss for layer in self.layers.values()
                  if layer is not None and layer.attention.indexer_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def auxiliary_loss(self) -> torch.Tensor | None:
        """DeepSeek-V3's terms plus indexer_loss_weight x indexer_loss()."""
        base, indexer = super().auxiliary_loss(), self.indexer_loss()
        if indexer is None:
            return base
        weighted = self.args.indexer_loss_weight * indexer
        return weighted if base is None else base + weighted

"""What the DeepSeek Sparse Attention families' tests share: weights away from init, and the indexer's KL loss
computed by hand from transformers' model and the DeepSeek-V3.2 report's definitions."""

from __future__ import annotations

import torch
from hf_reference import randomise


def randomise_dsa(model: torch.nn.Module, seed: int) -> None:
    """Weights away from init (router logits of order 1, a nonzero score bias), so a wrong mapping shows."""
    randomise(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.3 / 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def hand_indexer_loss(hf: torch.nn.Module, tokens: torch.Tensor, topk: int | None,
                      interleaved: bool = False) -> torch.Tensor:
    """Sum over the layers with an indexer of mean_s KL(p_s || softmax(I_s)) over the keys of the stage, from
    transformers' attention probabilities (p: summed over heads, L1-normalised) and the indexer's scores written out
    here: I[s, t] = sum_h w[s, h] ReLU(q[s, h] . k[t] / sqrt(D)) / sqrt(H) (w, q, k from the layer's normed input,
    RoPE on the first qk_rope_head_dim channels, in half-split pairs or, `interleaved`, in pairs (2i, 2i + 1)).
    topk None: the dense warm-up, every causal key; else the top-k causal keys by I (a layer without an indexer:
    the previous layer's keys)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    rotate = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb

    with torch.no_grad():
        out = hf(tokens, output_attentions=True, output_hidden_states=True)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        cos, sin = hf.model.rotary_emb(out.hidden_states[0], positions)
        total = torch.zeros(())
        seq = tokens.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        keys = causal.expand(tokens.shape[0], -1, -1)
        for layer, probs in enumerate(out.attentions):
            block = hf.model.layers[layer]
            attn, index = block.self_attn, block.self_attn.indexer
            p = probs.sum(1)
            p = p / p.sum(-1, keepdim=True)
            if index is None:  # the previous layer's keys; no indexer, no loss
                assert torch.all(p[~keys] == 0)
                continue
            x = block.input_layernorm(out.hidden_states[layer])
            b, h, d, r = x.shape[0], index.n_heads, index.head_dim, attn.qk_rope_head_dim
            q = index.wq_b(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, seq, h, d)
            k = index.k_norm(index.wk(x)).view(b, seq, 1, d)
            q_rot, k_rot = rotate(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
            q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
            w = index.weights_proj(x)
            scores = torch.einsum("bshd,btd->bsht", q, k) / d ** 0.5
            index_scores = torch.einsum("bsh,bsht->bst", w, scores.relu()) / h ** 0.5
            keys = causal.expand(b, -1, -1)
            if topk is not None:
                best = index_scores.masked_fill(~keys, float("-inf")).topk(min(topk, seq), dim=-1).indices
                keys = keys & torch.zeros_like(keys).scatter(-1, best, True)
            assert torch.all(p[~keys] == 0)  # transformers' attention used exactly these keys
            log_q = torch.log_softmax(index_scores.masked_fill(~keys, float("-inf")), dim=-1)
            kl = torch.where(p > 0, p * (p.log() - log_q), torch.zeros(()))
            total = total + kl.sum(-1).mean()
    return total



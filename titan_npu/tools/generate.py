"""`titan-npu generate`: sample text from a trained checkpoint with a KV cache, on any device.

The cache lives here, not in the model: CachedLlama runs the model's own modules (embedding, norms, projections,
feed-forward, output) and replaces only the attention's key/value handling, so every fused kernel the model uses
in training (titan_npu.ops) is used here too. Decoding is prefill (the prompt in one causal pass) followed by one
token at a time, each new query attending to all cached positions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.models.registry import spec_of

CONFIG_NAMES = ("config.toml", "config.yaml", "config.yml")


# ---------------------------------------------------------------------------------------------------- KV cache
class KVCache:
    """Keys and values of every layer for positions [0, max_len): each [batch, max_len, n_kv_heads, head_dim]."""

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, S, Hkv, D] at positions start.. and return all keys/values up to start + S."""
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CachedLlama:
    """Incremental decoding over a titan_npu Transformer: forward(tokens, start_pos) with a KV cache."""

    def __init__(self, model: nn.Module, max_len: int, batch_size: int = 1) -> None:
        if model.tok_embeddings is None or model.norm is None or model.output is None:
            raise ConfigError("generation needs the whole model (embedding, layers, norm, output), not a stage")
        refusal = spec_of(model.args).generate_refusal(model.args)
        if refusal is not None:
            raise ConfigError(refusal)
        self.model = model
        self.layers = list(model.layers.values())
        attn = self.layers[0].attention
        self.head_dim = attn.head_dim
        n_kv_heads = attn.wk.out_features // self.head_dim
        if max_len > model.freqs_cos.shape[0]:
            raise ConfigError(f"generation length {max_len} exceeds model.max_seq_len={model.freqs_cos.shape[0]}; "
                              "lower --max-new-tokens or use a shorter prompt")
        param = attn.wk.weight
        self.cache = KVCache(len(self.layers), batch_size, max_len, n_kv_heads, self.head_dim, param.dtype,
                             param.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: int, last_only: bool = False) -> torch.Tensor:
        """tokens [B, S] at positions start_pos.. -> logits [B, S, vocab] (or [B, 1, vocab] with last_only).

        start_pos is 0 (prefill, causal over the prompt) or the number of positions already cached with S == 1.
        """
        seqlen = tokens.shape[1]
        if start_pos > 0 and seqlen != 1:
            raise ValueError("after the prefill, decode one token at a time")
        if start_pos + seqlen > self.cache.max_len:
            raise ValueError(f"position {start_pos + seqlen} is beyond the cache ({self.cache.max_len})")
        m = self.model
        cos = m.freqs_cos[start_pos : start_pos + seqlen]
        sin = m.freqs_sin[start_pos : start_pos + seqlen]
        h = m.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer.attention, layer.attention_norm(h), cos, sin, start_pos)
            out = layer.feed_forward(layer.ffn_norm(h))
            h = h + (out[0] if isinstance(out, tuple) else out)  # a MoE layer returns its routing beside
        if last_only:
            h = h[:, -1:]
        return m.output(m.norm(h))

    def _attention(self, i: int, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   start_pos: int) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = attn.qkv(x, cos, sin)
        keys, values = self.cache.update(i, start_pos, xk, xv)
        # Prefill: the prompt attends causally to itself. Decode: the single new query sees every cached position,
        # so no mask at all (a top-left causal mask would be wrong once keys outnumber queries).
        out = ops.attention(xq, keys, values, causal=start_pos == 0, use_flash=attn.use_flash)
        return attn.wo(out.reshape(bs, seqlen, -1))


# ---------------------------------------------------------------------------------------------------- sampling
def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: greedy at temperature 0, else softmax(logits / T) within top-k/top-p."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    # In float64: a temperature past float32's range (1e308) would make the logits NaN, not near-uniform.
    logits = (logits.double() / temperature).float()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def banned_token_mask(model_vocab: int, tokenizer_vocab: int, banned: list[int | None], device: torch.device
                      ) -> torch.Tensor:
    """True for ids never to sample: those the tokenizer cannot decode (model vocab is padded) and `banned` (BOS)."""
    mask = torch.zeros(model_vocab, dtype=torch.bool, device=device)
    mask[tokenizer_vocab:] = True
    for i in banned:
        if i is not None and 0 <= i < model_vocab:
            mask[i] = True
    return mask


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 1.0,
    num_samples: int = 1,
    eos_id: int | None = None,
    banned: torch.Tensor | None = None,
    seed: int | None = None,
    stop_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """New token ids for each of num_samples continuations of prompt_ids (stopping at eos_id or one of stop_ids, a
    chat template's end of turn, which is dropped)."""
    stops = {i for i in (eos_id, *stop_ids) if i is not None}
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens; give a non-empty --prompt")
    device = model.tok_embeddings.weight.device
    total = min(len(prompt_ids) + max_new_tokens, model.freqs_cos.shape[0])
    decoder = CachedLlama(model, total, num_samples)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    tokens = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)
    logits = decoder.forward(tokens, 0, last_only=True)[:, -1]
    out: list[list[int]] = [[] for _ in range(num_samples)]
    done = torch.zeros(num_samples, dtype=torch.bool)
    pos = len(prompt_ids)
    for _ in range(max_new_tokens):
        if banned is not None:
            logits = logits.masked_fill(banned, float("-inf"))
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        for b, t in enumerate(nxt.tolist()):
            if done[b]:
                continue
            if t in stops:
                done[b] = True
            else:
                out[b].append(t)
        if bool(done.all()) or pos >= total:  # every sample ended, or model.max_seq_len is reached
            break
        logits = decoder.forward(nxt[:, None], pos)[:, -1]
        pos += 1
    return out


# -------------------------------------------------------------------------------------------------- loading
def find_config(checkpoint: Path) -> Path | None:
    """The run's config saved beside a checkpoint: in it (a dir), its folder, or up to two folders above."""
    start = checkpoint if checkpoint.is_dir() else checkpoint.parent
    for folder in (start, start.parent, start.parent.parent):
        for name in CONFIG_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint.dir holding step-N checkpoints means its latest one; anything else is taken as given."""
    from titan_npu.checkpoint import storage

    if path.is_dir() and not storage.is_complete(path):
        latest = storage.latest_checkpoint(path)
        if latest is not None:
            return latest.path
    return path

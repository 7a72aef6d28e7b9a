"""The dense decoder of Llama 2/3, Qwen2 and Qwen3: pre-norm blocks with RMSNorm, RoPE, GQA and SwiGLU.

The families differ only in options of DecoderArgs: biases on the q/k/v projections (Qwen2), an RMSNorm over each
head of q and k before RoPE and a head size set apart from dim / n_heads (Qwen3), and an output projection tied to
the embedding (the small models). Module and parameter names are Meta's (tok_embeddings, layers.N.attention.wq, ...),
so Meta checkpoints load as-is; each family's adapter maps Hugging Face names onto them. The model holds no parallel
code: tensor/pipeline/data parallelism are applied from outside (parallelize.py, pipeline.py). All math goes through
titan_npu.ops, which picks a fused kernel per device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_npu import ops
from titan_npu.errors import ConfigError
from titan_npu.models.decoder.args import (
    ROPE_SCALING_HIGH_FREQ_FACTOR,
    ROPE_SCALING_LOW_FREQ_FACTOR,
    ROPE_SCALING_ORIGINAL_CONTEXT,
    DecoderArgs,
)
from titan_npu.models.init import (
    ParamInit,
    attached_inits,
    constant,
    init_parameters,
    normal,
    prefixed,
    trunc_normal,
)
from titan_npu.ops.cross_entropy import chunked_linear_cross_entropy
from titan_npu.ops.documents import Documents


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling_factor: float | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i/head_dim), each [max_seq_len, head_dim/2] in fp32 (real, no complex)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling_factor is not None:
        inv_freq = scale_rope_frequencies(inv_freq, scaling_factor)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [S, D/2]
    return angles.cos(), angles.sin()


def scale_rope_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1 context extension: slow down the low frequencies by `factor`, keep the high ones, blend between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = ROPE_SCALING_ORIGINAL_CONTEXT / ROPE_SCALING_LOW_FREQ_FACTOR
    high_freq_wavelen = ROPE_SCALING_ORIGINAL_CONTEXT / ROPE_SCALING_HIGH_FREQ_FACTOR
    smooth = (ROPE_SCALING_ORIGINAL_CONTEXT / wavelen - ROPE_SCALING_LOW_FREQ_FACTOR) / (
        ROPE_SCALING_HIGH_FREQ_FACTOR - ROPE_SCALING_LOW_FREQ_FACTOR
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


class Linear(nn.Linear):
    """An nn.Linear (bias-free unless asked) whose matmul goes through ops.linear, the device's fastest kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.linear(x, self.weight)
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def param_inits(self) -> dict[str, ParamInit]:
        """A unit scale."""
        return {"weight": constant(1.0)}


class Attention(nn.Module):
    """Causal self-attention with rotary position embedding and grouped-query (GQA) key/value heads; optionally
    biases on q/k/v (Qwen2) and an RMSNorm over each head of q and k before the rotation (Qwen3)."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        # Global head counts; a tensor-parallel plan shards wq/wk/wv by columns, so forward reads the local count
        # from the projection sizes instead of these.
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.use_flash = args.use_flash_attention
        self.wq = Linear(args.dim, args.q_dim, bias=args.qkv_bias)
        self.wk = Linear(args.dim, args.kv_dim, bias=args.qkv_bias)
        self.wv = Linear(args.dim, args.kv_dim, bias=args.qkv_bias)
        self.wo = Linear(args.q_dim, args.dim)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        # Set by context parallelism (the parallelize step installs parallel/context_parallel.py's RingContext or
        # UlyssesContext): the true positions of the chunks of the sequence this rank holds, and attention across
        # the ranks that hold the rest. None: the whole sequence is here.
        self.context = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normalised per head if the model says so, then rotated) and v, each [B, S, heads, head_dim], of
        x [B, S, dim] at the positions whose cos/sin rows are given ([S, head_dim / 2])."""
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # [B, S, Hq, D]
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # [B, S, Hkv, D]
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = ops.apply_rotary_emb(xq, xk, cos, sin)
        return xq, xk, xv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim]; cos/sin: RoPE tables from position 0 with at least S rows (the first S are used);
        documents (data.document_mask): attention stops at their boundaries, RoPE takes their positions if any."""
        bs, seqlen, _ = x.shape
        # Sliced here, by the sequence attention actually sees: under sequence parallelism the residual stream the
        # model holds has S / tp positions, and the tensor-parallel plan gathers all S only at attention's input.
        if seqlen > cos.shape[0]:
            raise ConfigError(
                f"sequence length {seqlen} exceeds model.max_seq_len={cos.shape[0]}; "
                f"raise model.max_seq_len or lower training.seq_len"
            )
        if self.context is None:
            rows = slice(seqlen) if documents is None or documents.positions is None else documents.positions
            xq, xk, xv = self.qkv(x, cos[rows], sin[rows])
            out = ops.attention(xq, xk, xv, causal=True, use_flash=self.use_flash, documents=documents)  # [B,S,Hq,D]
        elif documents is None:
            positions = self.context.positions(seqlen, x.device)
            xq, xk, xv = self.qkv(x, cos[positions], sin[positions])
            out = self.context.attention(xq, xk, xv)
        else:
            positions = self.context.positions(seqlen, x.device, documents)
            xq, xk, xv = self.qkv(x, cos[positions], sin[positions])
            out = self.context.attention(xq, xk, xv, documents)
        return self.wo(out.reshape(bs, seqlen, -1))

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """q/k/v ~ N(0, 0.02), their biases 0; the output projection, which writes into the residual stream,
        ~ N(0, init_std); the per-head norms a unit scale."""
        inits = {f"{name}.weight": trunc_normal(0.02) for name in ("wq", "wk", "wv")}
        if self.wq.bias is not None:
            inits.update({f"{name}.bias": constant(0.0) for name in ("wq", "wk", "wv")})
        if self.q_norm is not None:
            inits.update({**prefixed("q_norm", self.q_norm.param_inits()),
                          **prefixed("k_norm", self.k_norm.param_inits())})
        return {**inits, "wo.weight": trunc_normal(init_std)}


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim)  # gate
        self.w2 = Linear(hidden_dim, dim)  # down
        self.w3 = Linear(dim, hidden_dim)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tensor parallel (w1/w3's sharding hooks) or a swapped-in linear (float8) run through their forward.
        if isinstance(self.w1.weight, DTensor) or type(self.w1) is not Linear:
            return self.w2(ops.swiglu(self.w1(x), self.w3(x)))
        return self.w2(ops.swiglu_linear(x, self.w1.weight, self.w3.weight))

    def param_inits(self, init_std: float) -> dict[str, ParamInit]:
        """Gate and up ~ N(0, 0.02); down, which writes into the residual stream, ~ N(0, init_std)."""
        return {"w1.weight": trunc_normal(0.02), "w3.weight": trunc_normal(0.02), "w2.weight": trunc_normal(init_std)}


class TransformerBlock(nn.Module):
    """One pre-norm layer: h = x + attention(norm(x)); out = h + feed_forward(norm(h)).

    `feed_forward` replaces the SwiGLU MLP (a family's MoE layer, whose block subclass defines its forward);
    `attention` replaces the attention (a module of the same call and param_inits contract: DeepSeek's MLA)."""

    def __init__(self, layer_id: int, args: DecoderArgs, feed_forward: nn.Module | None = None,
                 attention: nn.Module | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = attention if attention is not None else Attention(args)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # Depth-scaled init of the projections that write into the residual stream (torchtitan's depth_init):
        # deeper layers add smaller updates, which keeps the residual's variance bounded at initialisation.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x [B, S, dim] (S / tp positions under sequence parallelism); cos/sin: the model's whole RoPE tables;
        documents: the packed documents of the batch, for attention (data.document_mask)."""
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """The block's parameter distributions, by name within the block."""
        return {
            **prefixed("attention", self.attention.param_inits(self.weight_init_std)),
            **prefixed("feed_forward", self.feed_forward.param_inits(self.weight_init_std)),
            **prefixed("attention_norm", self.attention_norm.param_inits()),
            **prefixed("ffn_norm", self.ffn_norm.param_inits()),
        }


class Transformer(nn.Module):
    """Token embedding, n_layers TransformerBlocks, final RMSNorm, output projection (the embedding's matrix when
    args.tie_embeddings).

    A pipeline stage may delete layers and set tok_embeddings / norm / output to None: a stage without
    tok_embeddings takes hidden states [B, S, dim] as input, one without norm/output returns hidden states.
    """

    def __init__(self, args: DecoderArgs, block: Callable[[int, DecoderArgs], nn.Module] = TransformerBlock) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Not persistent: recomputed by init_weights, never saved, so checkpoints hold weights only.
        cos, sin = self.rope_tables(device=None)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        # A dict keyed "0".."N-1" rather than a list, so a pipeline stage can delete layers and keep FQNs stable.
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the output projection's weight the embedding's own parameter (tied models; a no-op otherwise).

        Called again wherever a parameter object is replaced (allocation after the meta device, tensor
        parallelism): each module would otherwise get a copy of its own.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def rope_tables(self, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE cos / sin tables of every position up to max_seq_len, in fp32 on `device`."""
        args = self.args
        return precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling_factor, device)

    def param_inits(self) -> dict[str, ParamInit]:
        """Each parameter's distribution under its name in the whole model (a stage lists only what it holds)."""
        inits: dict[str, ParamInit] = {}
        if self.tok_embeddings is not None:
            inits["tok_embeddings.weight"] = normal(0.02)
        for layer_id, layer in self.layers.items():
            if layer is not None:
                inits.update(prefixed(f"layers.{layer_id}", layer.param_inits()))
        if self.norm is not None:
            inits.update(prefixed("norm", self.norm.param_inits()))
        if self.output is not None and not self.args.tie_embeddings:
            # std dim^-0.5 makes the initial logits ~unit variance whatever the width (torchtitan's choice).
            std = self.args.dim**-0.5
            inits["output.weight"] = trunc_normal(std, low=-3 * std, high=3 * std)
        return inits

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter from `seed`, recompute the RoPE buffers (on buffer_device if given) and zero
        the routers' score biases (the MoE families').

        The weights depend on the seed and the model's shape only, never on how the model is split or sharded
        (models/init.py); seed None takes torch's current seed (`torch.manual_seed`). Call after
        `to_empty(device=...)` when the model was built on the meta device.
        """
        cos, sin = self.rope_tables(buffer_device or self.freqs_cos.device)
        self.freqs_cos, self.freqs_sin = cos, sin
        self.tie_weights()
        inits = {**self.param_inits(), **attached_inits(self)}  # attached: adapters (titan_npu/lora/)
        init_parameters(self, inits, torch.initial_seed() if seed is None else seed)
        for module in self.modules():
            if hasattr(module, "reset_score_bias"):
                module.reset_score_bias()

    def run_layers(self, h: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The blocks this model (or stage) holds, in order, on hidden states [B, S, dim]; documents: the batch's
        packed documents, handed to every block by argument (data.document_mask)."""
        # The whole tables: each attention takes the rows of the sequence it sees (and refuses one that is too long).
        for layer in self.layers.values():
            if layer is not None:
                h = layer(h, self.freqs_cos, self.freqs_sin, documents=documents)
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 0, documents: Documents | None = None) -> torch.Tensor:
        """tokens [B, S] (or hidden states [B, S, dim] when tok_embeddings is None) -> logits [B, S, vocab].

        With labels [B, S] (and the output projection on this part): the mean cross entropy instead of the logits,
        projected loss_chunk_tokens tokens at a time (titan_npu/ops/cross_entropy.py), so the logits are never whole.
        documents: the batch's packed documents (data.document_mask); every attention stops at their boundaries.
        They travel by argument down to each attention (an activation-checkpointed block recomputes with the ones
        its forward had, whatever ran since).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        h = self.run_layers(h, documents)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if labels is not None:
            return chunked_linear_cross_entropy(h, self.output.weight, labels, loss_chunk_tokens)
        return self.output(h)


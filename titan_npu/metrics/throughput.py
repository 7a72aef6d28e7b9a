"""FLOPs per token, tokens/s and MFU: the arithmetic behind the step line, free of clocks so it can be tested."""

from __future__ import annotations

from dataclasses import dataclass


def flops_per_token(non_embedding_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params (fwd + bwd matmuls) + 12 x layers x dim x seq (attention).

    6N counts a multiply-add as 2 FLOPs, once forward and twice backward, for every weight a token meets
    (the output projection included, the embedding lookup not). 12 L D S is attention's QK^T and AV matmuls
    over the whole sequence, forward and backward, without halving for the causal mask (PaLM's convention).
    """
    return 6.0 * non_embedding_params + 12.0 * n_layers * dim * seq_len


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float  # global, all devices
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float  # fraction of the device's peak, 0..1


def throughput(tokens: int, seconds: float, world_size: int, flops_per_tok: float, peak_flops: float) -> Throughput:
    """Figures for `tokens` (global, all ranks) processed in `seconds` of wall-clock by `world_size` devices."""
    seconds = max(seconds, 1e-9)
    global_tps = tokens / seconds
    per_device = global_tps / world_size
    achieved = per_device * flops_per_tok
    return Throughput(global_tps, per_device, achieved / 1e12, achieved / peak_flops if peak_flops > 0 else 0.0)

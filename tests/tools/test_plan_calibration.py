"""Calibration: the planner's activation estimate against the peak memory real CPU training steps allocate.

The measurement is torch's own allocator accounting: torch.profiler(profile_memory=True) records every CPU
allocation and free; their running sum over one forward + loss + backward, taken after a warm-up step so the
gradients already exist, peaks at what the step adds on top of parameters and gradients. The planner's figure for
the same quantity is activations (saved for backward) + the backward temporaries (loss buffers, a checkpointed
block's recomputation, autocast weight copies). Tolerance: 10% (the model matches to ~3% on these shapes).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from titan_npu import ops
from titan_npu.config.schema import ActivationCheckpointConfig, ModelConfig
from titan_npu.models.llama import LlamaArgs, Transformer
from titan_npu.models.registry import build_model, build_model_args
from titan_npu.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.activations import rank_activations
from titan_npu.planner.layout import Job, Layout
from titan_npu.planner.temporaries import temporary_bytes

TOLERANCE = 0.10
BATCH, SEQ = 2, 64


@pytest.fixture(autouse=True)
def _reference_kernels():
    # The estimate describes the reference ops; pin them whatever another test chose.
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def _peak_step_bytes(model: torch.nn.Module, autocast: bool, loss_chunk: int = 0) -> int:
    """Peak bytes one forward/backward allocates beyond what existed before it (parameters, gradients)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ))
    labels = torch.randint(0, model.args.vocab_size, (BATCH, SEQ))

    def step() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            if loss_chunk:
                model(tokens, labels=labels, loss_chunk_tokens=loss_chunk).backward()
                return
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()

    step()  # warm-up: gradients exist from here on, as in every step after the first
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


CASES = {
    # name: (model changes, dtype, activation checkpointing, how the parameters are held)
    "fp32, no checkpointing": ({}, "fp32", ("none", 2, False), "plain"),
    "fp32, full checkpointing": ({}, "fp32", ("full", 2, False), "plain"),
    "fp32, every 2nd block": ({}, "fp32", ("selective", 2, False), "plain"),
    "fp32, op-level selective": ({"n_layers": 6}, "fp32", ("selective", 2, True), "plain"),
    "fp32, eager attention": ({"use_flash_attention": False}, "fp32", ("none", 2, False), "plain"),
    "fp32, large vocabulary": ({"vocab_size": 2048}, "fp32", ("full", 2, False), "plain"),
    "bf16 parameters (FSDP mixed precision)": ({}, "bf16", ("none", 2, False), "bf16"),
    "bf16 autocast (single device)": ({}, "bf16", ("none", 2, False), "autocast"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_activation_estimate_matches_measured_cpu_peak(name):
    changes, dtype, (mode, every, op_level), held = CASES[name]
    fields = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=SEQ)
    args = LlamaArgs(**{**fields, **changes})
    torch.manual_seed(0)
    model = Transformer(args)
    if held == "bf16":
        model = model.to(torch.bfloat16)  # what FSDP's mixed precision computes with
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode, selective_every=every,
                                                                     selective_ops=op_level))
    measured = _peak_step_bytes(model, autocast=held == "autocast")

    # dp_shard=2 marks parameters held (and cast) by FSDP, as in the bf16 case; the rest run on one device.
    layout = Layout(Degrees(dp_shard=2 if held == "bf16" else 1), ac=mode, selective_every=every,
                    selective_ops=op_level, batch_size=BATCH)
    assert_estimate_matches(name, Job(args, SEQ, dtype), layout, measured)


QWEN_SHAPES = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=SEQ)
QWEN_CASES = {
    # name: (model.name, model changes on the debug flavor, dtype, activation checkpointing, parameters held)
    # Qwen3: per-head q/k norms, head_dim 64 where dim / n_heads is 16 (q is 256 wide, not 64), tied output.
    "qwen3 fp32, no checkpointing": ("qwen3", {"head_dim": 64}, "fp32", ("none", 2, False), "plain"),
    "qwen3 fp32, op-level selective": ("qwen3", {"head_dim": 64}, "fp32", ("selective", 2, True), "plain"),
    "qwen3 bf16 parameters (FSDP mixed precision)": ("qwen3", {"head_dim": 64}, "bf16", ("none", 2, False), "bf16"),
    "qwen3 bf16 autocast, large vocabulary": (
        "qwen3", {"head_dim": 64, "vocab_size": 2048}, "bf16", ("none", 2, False), "autocast"),
    # Qwen2.5: q/k/v biases, tied output.
    "qwen2 fp32, every 2nd block": ("qwen2", {}, "fp32", ("selective", 2, False), "plain"),
    "qwen2 bf16 autocast": ("qwen2", {}, "bf16", ("none", 2, False), "autocast"),
    # Wide against its 128 tokens: the tied output's gradient, waiting for the embedding's, decides the peak.
    "qwen2 bf16 autocast, dim 1024, one block": (
        "qwen2", {"dim": 1024, "n_heads": 8, "n_layers": 1, "ffn_dim": 256, "vocab_size": 2048}, "bf16",
        ("none", 2, False), "autocast"),
}


@pytest.mark.parametrize("name", list(QWEN_CASES))
def test_qwen_activation_estimate_matches_measured_cpu_peak(name):
    family, changes, dtype, (mode, every, op_level), held = QWEN_CASES[name]
    args = build_model_args(ModelConfig(name=family, flavor="debug", **{**QWEN_SHAPES, **changes}))
    assert args.tie_embeddings and (args.qk_norm or args.qkv_bias)
    torch.manual_seed(0)
    model = build_model(args)
    if held == "bf16":
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode, selective_every=every,
                                                                     selective_ops=op_level))
    measured = _peak_step_bytes(model, autocast=held == "autocast")
    layout = Layout(Degrees(dp_shard=2 if held == "bf16" else 1), ac=mode, selective_every=every,
                    selective_ops=op_level, batch_size=BATCH)
    assert_estimate_matches(name, Job(args, SEQ, dtype), layout, measured)


MOE_SHAPES = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, max_seq_len=SEQ,
                  n_experts=8, moe_ffn_dim=96)
MOE_CASES = {
    # name: (top_k, dtype, activation checkpointing, parameters held); the estimate assumes balanced routing, which
    # a freshly initialised router comes close to.
    "qwen3_moe fp32 top-2, no checkpointing": (2, "fp32", ("none", 2, False), "plain"),
    "qwen3_moe fp32 top-4, full checkpointing": (4, "fp32", ("full", 2, False), "plain"),
    "qwen3_moe fp32 top-2, op-level selective (experts recomputed)": (2, "fp32", ("selective", 2, True), "plain"),
    "qwen3_moe bf16 parameters (FSDP mixed precision)": (2, "bf16", ("none", 2, False), "bf16"),
}


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_activation_estimate_matches_measured_cpu_peak(name):
    top_k, dtype, (mode, every, op_level), held = MOE_CASES[name]
    args = build_model_args(ModelConfig(name="qwen3_moe", flavor="debug", top_k=top_k, **MOE_SHAPES))
    torch.manual_seed(0)
    model = build_model(args)
    if held == "bf16":
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode, selective_every=every,
                                                                     selective_ops=op_level))
    measured = _peak_step_bytes(model, autocast=False)
    layout = Layout(Degrees(dp_shard=2 if held == "bf16" else 1), ac=mode, selective_every=every,
                    selective_ops=op_level, batch_size=BATCH)
    assert_estimate_matches(name, Job(args, SEQ, dtype), layout, measured)


CHUNKED = {
    # name: (dtype, how the parameters are held, tokens per loss chunk); a vocabulary large enough to dominate
    "fp32, chunked loss": ("fp32", "plain", 32),
    "bf16 parameters (FSDP mixed precision), chunked loss": ("bf16", "bf16", 32),
    "bf16 autocast (single device), chunked loss": ("bf16", "autocast", 48),
}


@pytest.mark.parametrize("name", list(CHUNKED))
def test_chunked_loss_estimate_matches_measured_cpu_peak(name):
    dtype, held, chunk = CHUNKED[name]
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, ffn_dim=192, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = Transformer(args)
    if held == "bf16":
        model = model.to(torch.bfloat16)
    measured = _peak_step_bytes(model, autocast=held == "autocast", loss_chunk=chunk)
    layout = Layout(Degrees(dp_shard=2 if held == "bf16" else 1), batch_size=BATCH, loss_chunk_tokens=chunk)
    assert_estimate_matches(name, Job(args, SEQ, dtype), layout, measured)


def assert_estimate_matches(name: str, job: Job, layout: Layout, measured: int) -> None:
    """The planner's saved activations plus step temporaries for `job` under `layout` equal the measured peak."""
    acts = rank_activations(job, layout, 0, "cpu")
    temp = temporary_bytes(job, layout, 0, acts.extra, "cpu")
    estimate = acts.saved + temp.backward + temp.autocast
    assert estimate == pytest.approx(measured, rel=TOLERANCE), (
        f"{name}: estimate {estimate / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")

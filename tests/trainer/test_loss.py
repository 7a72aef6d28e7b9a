"""The chunked output projection + cross entropy equals the unchunked loss, and holds one chunk's logits at a time."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from titan_npu import ops
from titan_npu.config.schema import ModelConfig
from titan_npu.models.llama import Transformer
from titan_npu.models.registry import build_model_args
from titan_npu.parallel.degrees import Degrees
from titan_npu.planner.layout import Layout
from titan_npu.trainer.loss import IGNORE_INDEX, chunked_linear_cross_entropy, cross_entropy_loss

# fp32: the same products and fp32 sums in another order (chunked partial sums of the weight gradient).
FP32 = dict(atol=1e-6, rtol=1e-5)


def _inputs(tokens: int = 18, dim: int = 16, vocab: int = 40, dtype=torch.float32, ignore: int = 3):
    torch.manual_seed(0)
    h = torch.randn(2, tokens // 2, dim, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, dim) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2))
    labels.view(-1)[:ignore] = IGNORE_INDEX
    return h, w, labels


def _loss_and_grads(loss_fn, h, w, labels):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")  # the same matmul kernel on both sides
    yield
    ops.set_kernels("auto")


def unchunked(h, w, labels):
    return cross_entropy_loss(torch.nn.functional.linear(h, w), labels)


@pytest.mark.parametrize("chunk", [1, 5, 18, 100], ids=["1", "5-ragged", "exact", "larger"])
def test_chunked_loss_and_gradients_equal_the_unchunked_within_fp32_rounding(chunk):
    h, w, labels = _inputs()
    want = _loss_and_grads(unchunked, h, w, labels)
    got = _loss_and_grads(lambda *a: chunked_linear_cross_entropy(*a, chunk), h, w, labels)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **FP32)


def test_under_autocast_both_paths_compute_in_bf16_and_agree_within_bf16_rounding():
    h, w, labels = _inputs(tokens=64, vocab=128)

    def under_autocast(fn):
        def run(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*args)
        return run

    want = _loss_and_grads(under_autocast(unchunked), h, w, labels)
    got = _loss_and_grads(under_autocast(lambda *a: chunked_linear_cross_entropy(*a, 16)), h, w, labels)
    assert got[2].dtype == torch.float32  # fp32 weights get fp32 gradients, as through autocast's linear
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-6)  # the same bf16 logits, the same fp32 sums
    for g, r in zip(got[1:], want[1:], strict=True):  # one bf16 rounding apart at most (2^-8 relative)
        torch.testing.assert_close(g.float(), r.float(), atol=1e-4, rtol=2**-7)


def test_without_autograd_only_the_loss_is_computed():
    h, w, labels = _inputs()
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, labels, 4)
    torch.testing.assert_close(loss, unchunked(h, w, labels).detach(), **FP32)


@pytest.mark.parametrize("family", [{"name": "llama3"}, {"name": "qwen3", "head_dim": 16, "ffn_dim": 64}],
                         ids=["llama3", "qwen3_tied"])
def test_the_model_returns_the_chunked_loss_with_the_unchunked_gradients(family):
    # Qwen3 ties the output to the embedding: the chunked loss's weight gradient adds to the lookup's.
    args = build_model_args(ModelConfig(**family, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                                        max_seq_len=16))
    assert args.tie_embeddings == (family["name"] == "qwen3")
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights()
    tokens, labels = torch.randint(0, 96, (3, 16)), torch.randint(0, 96, (3, 16))
    cross_entropy_loss(model(tokens), labels).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss = model(tokens, labels=labels, loss_chunk_tokens=7)
    loss.backward()
    torch.testing.assert_close(loss, cross_entropy_loss(model(tokens), labels), **FP32)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], **FP32, msg=name)


def _peak_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        current += nbytes
        peak = max(peak, current)
    return peak


def test_peak_memory_is_bounded_by_the_chunk_not_the_micro_batch():
    h, w, labels = _inputs(tokens=2048, dim=32, vocab=4096, ignore=0)
    logits_fp32 = 2048 * 4096 * 4  # 32 MiB: what the unchunked loss holds several of
    whole = _peak_bytes(lambda: unchunked(h, w, labels).backward())
    chunked = _peak_bytes(lambda: chunked_linear_cross_entropy(h, w, labels, 128).backward())
    assert whole > 2 * logits_fp32
    # One 128-token chunk's logits (2 MiB) and softmax, the 0.5 MiB weight gradient (fp32 sum and result), the
    # hidden states' gradient: under a quarter of one whole fp32 logits tensor.
    assert chunked < logits_fp32 / 4, (chunked, whole)


def _allocations_of_at_least(nbytes: int, fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(1 for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() >= nbytes)


def test_each_chunk_allocates_one_logits_sized_buffer_for_its_loss_and_gradient():
    # A second [chunk, V] buffer (torch.logsumexp's shifted copy), allocated and freed inside the forward, made
    # glibc hand the top of its heap back to the system on CPU, to be faulted in again by the next step.
    tokens, vocab, chunk = 256, 1024, 64
    h, w, labels = _inputs(tokens=tokens, dim=32, vocab=vocab, ignore=0)
    logits_bytes = chunk * vocab * 4  # 256 KiB; the gradients of h and w are smaller
    n = _allocations_of_at_least(logits_bytes, lambda: chunked_linear_cross_entropy(h, w, labels, chunk).backward())
    assert n == tokens // chunk


def test_tensor_and_pipeline_parallel_runs_take_the_whole_logits():
    assert Degrees().loss_chunk_tokens(2048) == 2048
    assert Degrees(tp=2).loss_chunk_tokens(2048) == 0  # loss_parallel: vocab-sharded logits
    assert Degrees(pp=2).loss_chunk_tokens(2048) == 0  # the schedule's loss_fn sees the last stage's output
    assert Degrees().loss_chunk_tokens(0) == 0
    # The planner's layouts size the loss's temporaries by the same rule.
    assert Layout(Degrees(dp_shard=2), loss_chunk_tokens=2048).loss_chunk == 2048
    assert Layout(Degrees(tp=2), loss_chunk_tokens=2048).loss_chunk == 0

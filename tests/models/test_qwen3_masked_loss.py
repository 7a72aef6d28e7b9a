"""Fine-tuning loss of a tiny Hugging Face Qwen3 imported into titan-npu, labels -100 outside a given answer span of
each sequence: the step's loss as the trainer computes it (two accumulated micro-batches of different valid counts,
each mean weighted by token_weight; chunked and whole-logit cross entropy) equals transformers' own loss
(`labels=`, shifted inside) on the whole batch (fp32, 1e-5 relative), and 20 AdamW steps of it track a plain
transformers loop as the families' parity tests do (1e-4 relative per step)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hf_reference import adamw_steps, hf_model, import_hf_model, randomise, use_reference_kernels

from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.ops.cross_entropy import IGNORE_INDEX
from titan_npu.trainer.loss import model_loss, stand_in_labels, token_weight, valid_labels

transformers = pytest.importorskip("transformers")

ARGS = DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=160, ffn_dim=96,
                   norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=128, qk_norm=True, family="qwen3",
                   tie_embeddings=True)
SEQ = 33  # tokens per sequence: 32 predicted
LOSS_RTOL = 1e-5
STEP_RTOL = 1e-4
ACCUM = 2

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


def _answers(tokens: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """transformers-style labels: the tokens inside each row's [start, end) (the answer), -100 elsewhere."""
    positions = torch.arange(tokens.shape[1])
    inside = (positions >= starts[:, None]) & (positions < ends[:, None])
    return tokens.masked_fill(~inside, IGNORE_INDEX)


def _pool(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences and their answer-masked labels; answers of 2 to 20 tokens, so micro-batches differ."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (8, SEQ), generator=gen)
    starts = torch.randint(4, 12, (8,), generator=gen)
    ends = starts + torch.tensor([2, 20, 3, 18, 12, 4, 20, 2])
    return tokens, _answers(tokens, starts, ends)


def _our_step_loss(chunk_tokens: int):
    """The trainer's step loss on (tokens, hf_labels): next-token labels, ACCUM micro-batches, each mean weighted
    by its valid labels over the step's (token_weight; one process: the share is ACCUM) and scaled by 1 / ACCUM."""

    def loss_fn(model: torch.nn.Module, tokens: torch.Tensor, hf_labels: torch.Tensor) -> torch.Tensor:
        inputs, labels = tokens[:, :-1], hf_labels[:, 1:]
        parts = list(zip(inputs.chunk(ACCUM), labels.chunk(ACCUM), strict=True))
        counts = [valid_labels(y) for _, y in parts]
        total = 0.0
        for (x, y), count in zip(parts, counts, strict=True):
            weight = token_weight(count, ACCUM, sum(counts))
            y = y if weight else stand_in_labels(y)
            total = total + model_loss(model, x, y, contextlib.nullcontext, chunk_tokens) * weight / ACCUM
        return total

    return loss_fn


def _hf_loss(model: torch.nn.Module, tokens: torch.Tensor, hf_labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=hf_labels).loss


@pytest.mark.parametrize("chunk_tokens", [0, 16], ids=["whole-logits", "chunked"])
def test_the_first_step_loss_on_answer_tokens_equals_transformers(chunk_tokens):
    hf = hf_model("qwen3", ARGS)
    randomise(hf, 3)
    ours = import_hf_model("qwen3", hf, ARGS, tie_word_embeddings=True)
    tokens, hf_labels = _pool(5)
    tokens, hf_labels = tokens[:4], hf_labels[:4]  # micro-batches of 2 + 20 and 3 + 18 answer tokens
    with torch.no_grad():
        want = _hf_loss(hf, tokens, hf_labels).item()
        got = _our_step_loss(chunk_tokens)(ours, tokens, hf_labels).item()
        # Guards the comparison: the mean of the micro-batches' means is another number, well outside the tolerance.
        means = [torch.nn.functional.cross_entropy(hf(t).logits[:, :-1].flatten(0, 1), y[:, 1:].flatten()).item()
                 for t, y in zip(tokens.chunk(ACCUM), hf_labels.chunk(ACCUM), strict=True)]
    assert abs(got - want) <= LOSS_RTOL * want, (got, want)
    assert abs(sum(means) / ACCUM - want) > 10 * LOSS_RTOL * want


def test_twenty_answer_only_steps_from_the_imported_weights_track_a_transformers_loop():
    hf = hf_model("qwen3", ARGS).train()
    randomise(hf, 7)
    ours = import_hf_model("qwen3", hf, ARGS, tie_word_embeddings=True).train()
    tokens, hf_labels = _pool(9)
    gen = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(20):
        rows = torch.randint(0, 8, (4,), generator=gen)
        batches.append((tokens[rows], hf_labels[rows]))
    ours_losses = adamw_steps(ours, batches, _our_step_loss(16))
    hf_losses = adamw_steps(hf, batches, _hf_loss)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses, strict=True)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"

"""The loss of a chat batch from the loader, on a tiny model imported from Hugging Face, equals transformers' loss of
the same conversations with labels -100 outside the assistant tokens (fp32, 1e-5): the labels are the assistant
tokens, shifted as transformers shifts them, and the padding adds nothing."""

from __future__ import annotations

import pytest
import torch
from data_helpers import write_jsonl

from titan_npu import ops
from titan_npu.data import build_tokenizer
from titan_npu.data.chat import encode_conversation, load_chat_template
from titan_npu.data.loader import build_dataloader
from titan_npu.models.llama import LlamaArgs, Transformer, from_hf, hf_config
from titan_npu.ops.cross_entropy import IGNORE_INDEX, cross_entropy_loss

transformers = pytest.importorskip("transformers")

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264, ffn_dim=128, norm_eps=1e-5,
                 rope_theta=10000.0, max_seq_len=128, family="llama3")
TOL = 1e-5


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def test_the_loss_of_a_chat_batch_equals_transformers_loss_with_labels_outside_assistant_tokens_ignored(
        tmp_path, small_cfg):
    records = [{"messages": [{"role": "system", "content": "Be brief."}] * (i % 2)
                + [{"role": "user", "content": f"{i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."},
                   {"role": "user", "content": "and?"}, {"role": "assistant", "content": "done"}]}
               for i in range(8)]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    cfg = small_cfg(str(path), batch_size=4, seq_len=96, format="chat", pack=False)
    cfg.training.seed = 3
    byte = build_tokenizer("byte")
    inputs, labels = next(build_dataloader(cfg, byte, 0, 1, model_vocab_size=ARGS.vocab_size))

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(ARGS), attn_implementation="eager"))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.08)
    hf.eval()
    ours = Transformer(ARGS)
    ours.load_state_dict(from_hf(hf.state_dict(), ARGS), strict=True)
    with torch.no_grad():
        loss = cross_entropy_loss(ours(inputs), labels).item()

    # transformers, one conversation at a time (no padding), labels = its ids where the assistant mask is on
    template = load_chat_template(byte, "byte")
    total, count, rows = 0.0, 0, 0
    by_ids = {}
    for r in records:
        ids, mask = encode_conversation(r["messages"], template, byte)
        by_ids[tuple(ids[:-1])] = (ids, mask)
    for row in inputs.tolist():
        ids, mask = next(v for k, v in by_ids.items() if row[: len(k)] == list(k))  # the conversation of this row
        ids_t = torch.tensor([ids])
        hf_labels = torch.where(torch.tensor([mask.astype(bool)]), ids_t, torch.tensor(IGNORE_INDEX))
        with torch.no_grad():
            out = hf(input_ids=ids_t, labels=hf_labels)
        n = int((hf_labels[:, 1:] != IGNORE_INDEX).sum())
        total += out.loss.item() * n
        count += n
        rows += 1
    assert rows == 4 and count == int((labels != IGNORE_INDEX).sum())
    assert abs(loss - total / count) < TOL, (loss, total / count)

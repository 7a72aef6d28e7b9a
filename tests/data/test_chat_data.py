"""Chat and instruction data for SFT: labels only on assistant tokens, whole conversations packed into windows with
document masks (or one per window, padded), overlong ones truncated or dropped and counted, prepare-data --format chat
giving the batches of the raw path, and every malformed record refused in one line (or counted and skipped)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_helpers import write_jsonl

from titan_npu.data import build_tokenizer
from titan_npu.data.chat import encode_conversation, load_chat_template
from titan_npu.data.loader import build_dataloader
from titan_npu.errors import DataError
from titan_npu.ops.cross_entropy import IGNORE_INDEX

BYTE = build_tokenizer("byte")
TEMPLATE = load_chat_template(BYTE, "byte")


def conversation(i: int, turns: int = 1, system: bool = False) -> dict:
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for t in range(turns):
        messages += [{"role": "user", "content": f"q{i}.{t}?"}, {"role": "assistant", "content": f"a{i}.{t}"}]
    return {"messages": messages}


def chat_file(tmp_path, n: int = 40, name: str = "chat.jsonl"):
    return write_jsonl(tmp_path / name, [conversation(i, 1 + i % 3, system=i % 2 == 0) for i in range(n)])


def batches(small_cfg, path, n: int = 3, **data):
    data.setdefault("format", "chat")
    cfg = small_cfg(str(path), seq_len=data.pop("seq_len", 64), **data)
    loader = build_dataloader(cfg, BYTE, 0, 1, model_vocab_size=512)
    return loader, [next(loader) for _ in range(n)]


def test_labels_are_the_assistant_tokens_only(tmp_path, small_cfg):
    loader, got = batches(small_cfg, chat_file(tmp_path), document_mask=True)
    windows = loader.windows
    for _, labels, _ in got:
        kept = labels[labels != IGNORE_INDEX].tolist()
        text = bytes(t for t in kept if t < 256).decode()
        assert "q" not in text and "Be brief" not in text and "<|" not in text  # no user, system or scaffolding
        assert text and all(c in "a0123456789." for c in text)
    # every window's labels are exactly its conversations' assistant masks, shifted by one
    for w in range(windows.num_windows):
        tokens, mask = windows.window(w), windows.label_mask(w)
        expected = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
        from titan_npu.data.windows import batch_of

        _, labels = batch_of([(windows, w)], 512, "")
        assert labels[0].tolist() == expected.tolist()


def test_packed_conversations_stay_whole_and_never_attend_to_each_other(tmp_path, small_cfg):
    path = chat_file(tmp_path)
    loader, got = batches(small_cfg, path, document_mask=True, seq_len=100)
    windows = loader.windows
    records = [json.loads(line) for line in path.read_text().splitlines()]
    encoded = [encode_conversation(r["messages"], TEMPLATE, BYTE)[0] for r in records]
    seen = []
    for w in range(windows.num_windows):
        row, starts = windows.window(w), list(windows.doc_starts(w)) + [windows.seq_len + 1]
        for lo, hi in zip(starts, starts[1:]):
            piece = row[lo:hi].tolist()
            if piece and piece[0] == BYTE.bos_id:
                seen.append(piece)  # a whole conversation: it starts with the template's BOS ...
            else:
                assert set(piece) == {BYTE.eos_id}  # ... or it is the padding
    cap = windows.seq_len + 1  # the longer ones are cut at seq_len + 1 tokens (overlong = "truncate")
    assert sorted(map(tuple, seen)) == sorted(tuple(e[:cap]) for e in encoded)  # each one exactly once, in one window
    assert windows.truncated == sum(len(e) > cap for e in encoded)
    assert windows.num_windows < len(encoded)  # several per window
    inputs, labels, docs = got[0]
    for row in range(inputs.shape[0]):
        ids = docs.ids[row]
        boundaries = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
        for b in boundaries.tolist():
            assert inputs[row, b].item() in (BYTE.bos_id, BYTE.eos_id)  # a new conversation (or the padding) begins


def test_without_packing_each_window_holds_one_conversation_and_padding_is_no_label(tmp_path, small_cfg):
    loader, got = batches(small_cfg, chat_file(tmp_path), pack=False)
    assert loader.windows.num_windows == 40
    for inputs, labels in got:
        for row in range(inputs.shape[0]):
            assert (inputs[row] == BYTE.bos_id).sum() == 1
            pad = inputs[row] == BYTE.eos_id
            tail = pad.nonzero().flatten()
            if len(tail) > 1:  # the padding after the conversation's own EOS is never a label
                assert (labels[row, tail[1]:] == IGNORE_INDEX).all()


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, small_cfg, caplog):
    long = {"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "x" * 200}]}
    only_prompt_fits = {"messages": [{"role": "user", "content": "y" * 200}, {"role": "assistant", "content": "z"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(10)] + [long, only_prompt_fits])
    with caplog.at_level("INFO", logger="titan_npu"):
        loader, _ = batches(small_cfg, path, n=1, seq_len=48)
    truncated = loader.windows
    assert (truncated.truncated, truncated.dropped, truncated.num_conversations) == (1, 1, 11)
    assert "12 conversations" not in caplog.text and "1 longer than that truncated, 1 dropped" in caplog.text
    loader, _ = batches(small_cfg, path, n=1, seq_len=48, overlong="drop")
    assert (loader.windows.truncated, loader.windows.dropped, loader.windows.num_conversations) == (0, 2, 10)
    assert max(truncated.lengths) == 49  # cut at seq_len + 1: its end goes, its start stays


def test_instruction_records_with_configured_fields_and_a_system_prompt(tmp_path, small_cfg):
    path = write_jsonl(tmp_path / "i.jsonl", [{"q": f"question {i}", "a": f"answer {i}", "sys": "Be kind."}
                                              for i in range(20)])
    loader, got = batches(small_cfg, path, format="instruction", prompt_field="q", response_field="a",
                          system_field="sys")
    expected, _ = encode_conversation([{"role": "system", "content": "Be kind."},
                                       {"role": "user", "content": "question 0"},
                                       {"role": "assistant", "content": "answer 0"}], TEMPLATE, BYTE)
    assert loader.windows.dataset.read(0, 0, len(expected)).tolist() == expected
    kept = got[0][1][got[0][1] != IGNORE_INDEX].tolist()
    assert "answer" in bytes(t for t in kept if t < 256).decode()


def test_prepare_data_format_chat_gives_the_batches_of_the_raw_path(tmp_path, small_cfg):
    from titan_npu.commands.prepare_data import main

    path = chat_file(tmp_path, n=60)
    assert main([str(path), "--output", str(tmp_path / "prep"), "--format", "chat", "--shard-size", "500"]) == 0
    assert len(list((tmp_path / "prep").glob("shard_*.mask.bin"))) > 1
    _, raw = batches(small_cfg, path, n=6, document_mask=True)
    _, prepared = batches(small_cfg, tmp_path / "prep", n=6, document_mask=True)
    for a, b in zip(raw, prepared):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2].ids, b[2].ids)
    # data.format = "text" on a prepared chat folder still reads its mask; a text folder is refused for chat
    _, as_text = batches(small_cfg, tmp_path / "prep", n=1, format="text", document_mask=True)
    assert torch.equal(as_text[0][1], raw[0][1])


def test_an_edited_loss_mask_is_refused(tmp_path, small_cfg):
    from titan_npu.commands.prepare_data import main

    assert main([str(chat_file(tmp_path)), "--output", str(tmp_path / "prep"), "--format", "chat"]) == 0
    mask = next((tmp_path / "prep").glob("shard_*.mask.bin"))
    data = bytearray(mask.read_bytes())
    data[5] ^= 1
    mask.write_bytes(bytes(data))
    with pytest.raises(DataError, match="does not match its checksum"):
        batches(small_cfg, tmp_path / "prep", n=1)


BAD_RECORDS = {
    "no messages": ({"text": "hello"}, "no 'messages' field"),
    "messages not a list": ({"messages": "hi"}, "'messages' is a string, not a non-empty list"),
    "empty messages": ({"messages": []}, "not a non-empty list"),
    "unknown role": ({"messages": [{"role": "bot", "content": "x"}]}, "has role 'bot'; roles are"),
    "empty assistant turn": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
                             "is an empty assistant turn"),
    "no assistant turn": ({"messages": [{"role": "user", "content": "q"}]}, "has no assistant turn"),
    "content not a string": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
                             "content is a number, not a string"),
    "message not an object": ({"messages": ["hi", {"role": "assistant", "content": "a"}]}, "not an object"),
    "record not an object": ([1, 2], "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_malformed_record_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, case):
    from titan_npu.cli import main

    record, problem = BAD_RECORDS[case]
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(0), record, conversation(1)])
    rc = main(["prepare-data", str(path), "--output", str(tmp_path / "out"), "--format", "chat"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and problem in lines[0] and f"{path}:2" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_bad_json_and_a_raising_template_are_refused_with_their_own_message(tmp_path, small_cfg):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(conversation(0)) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"c.jsonl:2: malformed JSON .*data.skip_bad_records"):
        batches(small_cfg, path, n=1)
    template = tmp_path / "strict.jinja"
    template.write_text("{% if messages[0].role != 'system' %}{{ raise_exception('a system message must come "
                        "first') }}{% endif %}{% generation %}{{ messages[-1].content }}{% endgeneration %}")
    good = write_jsonl(tmp_path / "g.jsonl", [conversation(0, system=True), conversation(1)])
    with pytest.raises(DataError, match="g.jsonl:2: the chat template .*strict.jinja raised: a system message must "
                                        "come first"):
        batches(small_cfg, good, n=1, chat_template=str(template))
    sandbox = tmp_path / "escape.jinja"
    sandbox.write_text("{% generation %}{{ messages.__class__.__mro__ }}{% endgeneration %}")
    with pytest.raises(DataError, match="escape.jinja raised"):
        batches(small_cfg, good, n=1, chat_template=str(sandbox))


def test_bad_records_are_counted_and_skipped_only_when_asked(tmp_path, small_cfg, capsys):
    from titan_npu.commands.prepare_data import main

    records = [conversation(i) for i in range(30)]
    records[3] = {"messages": [{"role": "user", "content": "q"}]}
    records[7] = {"prompt": "x"}
    path = write_jsonl(tmp_path / "c.jsonl", records)
    loader, _ = batches(small_cfg, path, n=1, skip_bad_records=True)
    assert loader.windows.num_conversations == 28
    assert main([str(path), "--output", str(tmp_path / "prep"), "--format", "chat", "--skip-bad-records"]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 bad record(s)" in err and "c.jsonl:4" in err
    assert json.loads((tmp_path / "prep" / "index.json").read_text())["num_documents"] == 28


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    from chat_helpers import CHATML_SPECIALS, write_byte_level_tokenizer

    from titan_npu.cli import main

    folder = write_byte_level_tokenizer(tmp_path / "base", CHATML_SPECIALS, {"eos_token": "<|endoftext|>"})
    rc = main(["prepare-data", str(chat_file(tmp_path)), "--output", str(tmp_path / "out"), "--format", "chat",
               "--tokenizer", str(folder)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "has no chat template" in lines[0] and "data.chat_template" in lines[0]
    assert not (tmp_path / "out").exists()

"""Chat templates: the token ids and the assistant mask equal transformers' apply_chat_template(...,
return_assistant_tokens_mask=True) for the shipped byte template, a Qwen3-style one and a Llama 3 one on the published
Llama 3.2 tokenizer (tokenizer.json and tiktoken tokenizer.model); templates without generation markers (Qwen3's own)
get the mask of their marked twin; templates come from the tokenizer's files or an override."""

from __future__ import annotations

import json

import pytest
from chat_helpers import (
    BYTE_SPECIALS,
    CHATML_SPECIALS,
    LLAMA3_MARKED,
    LLAMA3_PLAIN,
    QWEN3_REAL,
    QWEN3_REAL_MARKED,
    QWEN3_STYLE_MARKED,
    hf_tokenizer,
    write_byte_level_tokenizer,
)
from data_helpers import LLAMA_DIR, needs_llama

from titan_npu.data import build_tokenizer
from titan_npu.data.chat import BYTE_TEMPLATE, ChatTemplate, encode_conversation, load_chat_template
from titan_npu.errors import DataError

pytest.importorskip("transformers")

SYSTEM_MULTI_TURN = [
    {"role": "system", "content": "Be brief. Ünïcode: 漢字"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello ü"},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "4."},
]
WITH_TOOL = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": 'weather("Oslo")'},
    {"role": "tool", "content": "snow, -3 C"},
    {"role": "assistant", "content": "Snow in Oslo."},
]
WITH_REASONING = [
    {"role": "system", "content": "Think first."},
    {"role": "user", "content": "3 times 3?"},
    {"role": "assistant", "content": "9", "reasoning_content": "three threes"},
    {"role": "user", "content": "and 4 times 4?"},
    {"role": "assistant", "content": "16", "reasoning_content": "four fours"},
]
CONVERSATIONS = {"system+multi-turn": SYSTEM_MULTI_TURN, "tool": WITH_TOOL, "reasoning": WITH_REASONING}


def _transformers(folder, messages):
    out = hf_tokenizer(folder).apply_chat_template(messages, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _ours(tokenizer, template, messages):
    ids, mask = encode_conversation(messages, template, tokenizer)
    return ids, mask.tolist()


@pytest.fixture(scope="module")
def byte_twin(tmp_path_factory):
    """The byte tokenizer as a Hugging Face tokenizer.json (id = byte, <s> = 256, </s> = 257) with the shipped
    template in its tokenizer_config.json."""
    return write_byte_level_tokenizer(tmp_path_factory.mktemp("byte"), BYTE_SPECIALS, {
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": BYTE_TEMPLATE.read_text(encoding="utf-8")})


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return write_byte_level_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML_SPECIALS, {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN3_STYLE_MARKED})


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_the_shipped_byte_template_gives_transformers_ids_and_assistant_mask(byte_twin, name):
    messages = CONVERSATIONS[name]
    expected_ids, expected_mask = _transformers(byte_twin, messages)
    byte = build_tokenizer("byte")
    ids, mask = _ours(byte, load_chat_template(byte, "byte"), messages)
    assert ids == expected_ids
    assert mask == expected_mask
    # the same through the tokenizer.json twin, its template read from its tokenizer_config.json
    twin = build_tokenizer(str(byte_twin / "tokenizer.json"))
    assert _ours(twin, load_chat_template(twin, str(byte_twin / "tokenizer.json")), messages) == (ids, mask)
    assert sum(mask) > 0 and mask[0] == 0


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_a_qwen3_style_template_with_generation_markers_gives_transformers_ids_and_mask(chatml, name):
    messages = CONVERSATIONS[name]
    tok = build_tokenizer(str(chatml))
    assert _ours(tok, load_chat_template(tok, str(chatml)), messages) == _transformers(chatml, messages)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3s_own_template_without_markers_gets_the_mask_of_its_marked_twin(chatml, tmp_path, name):
    messages = CONVERSATIONS[name]
    marked = write_byte_level_tokenizer(tmp_path / "marked", CHATML_SPECIALS, {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN3_REAL_MARKED})
    expected_ids, expected_mask = _transformers(marked, messages)
    tok = build_tokenizer(str(chatml))
    real = ChatTemplate(QWEN3_REAL, "qwen3", tok.special_tokens())
    assert not real.has_generation and real.end_of_turn == "<|im_end|>"
    hf = hf_tokenizer(chatml)
    assert real.render(messages)[0] == hf.apply_chat_template(messages, tokenize=False, chat_template=QWEN3_REAL)
    assert _ours(tok, real, messages) == (expected_ids, expected_mask)


def test_the_generation_prompt_is_rendered_as_transformers_renders_it(chatml):
    tok = build_tokenizer(str(chatml))
    template = load_chat_template(tok, str(chatml))
    text, _ = template.render(SYSTEM_MULTI_TURN[:2], add_generation_prompt=True)
    assert text == hf_tokenizer(chatml).apply_chat_template(SYSTEM_MULTI_TURN[:2], tokenize=False,
                                                            add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_jinja_beside_the_tokenizer_wins_over_tokenizer_config(chatml, tmp_path):
    folder = write_byte_level_tokenizer(tmp_path / "tok", CHATML_SPECIALS, {"eos_token": "<|im_end|>",
                                                                            "chat_template": "{{ 'config' }}"})
    (folder / "chat_template.jinja").write_text(QWEN3_STYLE_MARKED, encoding="utf-8")
    tok = build_tokenizer(str(folder))
    assert load_chat_template(tok, str(folder)).text == QWEN3_STYLE_MARKED


def test_data_chat_template_overrides_the_tokenizers_own(chatml, tmp_path):
    override = tmp_path / "mine.jinja"
    override.write_text(QWEN3_REAL, encoding="utf-8")
    tok = build_tokenizer(str(chatml))
    assert load_chat_template(tok, str(chatml), str(override)).text == QWEN3_REAL
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "default", "template": QWEN3_REAL}]}))
    assert load_chat_template(tok, str(chatml), str(config)).text == QWEN3_REAL


def test_a_tokenizer_without_a_template_and_no_override_is_refused(tmp_path):
    folder = write_byte_level_tokenizer(tmp_path / "plain", CHATML_SPECIALS, {"eos_token": "<|im_end|>"})
    tok = build_tokenizer(str(folder))
    with pytest.raises(DataError, match=r"has no chat template .*set data.chat_template \(--chat-template\)"):
        load_chat_template(tok, str(folder))


def test_a_template_with_a_syntax_error_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n", encoding="utf-8")
    byte = build_tokenizer("byte")
    with pytest.raises(DataError, match=r"bad.jinja is not a valid jinja2 template \(line 2"):
        load_chat_template(byte, "byte", str(bad))


@needs_llama
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_the_llama_3_2_tokenizer_json_and_tokenizer_model_give_transformers_ids_and_mask(tmp_path, name):
    """Real merges: the published Llama 3.2 tokenizer, as tokenizer.json and as the tiktoken tokenizer.model, with a
    Llama 3 template marked (held to transformers) and unmarked (the derived mask must be the same)."""
    import shutil

    messages = CONVERSATIONS[name]
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(LLAMA_DIR / "tokenizer.json", folder)
    config = json.loads((LLAMA_DIR / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_MARKED}))
    expected = _transformers(folder, messages)
    assert sum(expected[1]) > 0
    tok = build_tokenizer(str(folder))
    assert _ours(tok, load_chat_template(tok, str(folder)), messages) == expected
    plain = ChatTemplate(LLAMA3_PLAIN, "llama3 (no markers)", tok.special_tokens())
    assert plain.end_of_turn == "<|eot_id|>" and _ours(tok, plain, messages) == expected
    tiktoken_dir = tmp_path / "tiktoken"
    tiktoken_dir.mkdir()
    shutil.copy(LLAMA_DIR / "tokenizer.model", tiktoken_dir)
    shutil.copy(LLAMA_DIR / "tokenizer_config.json", tiktoken_dir)
    pytest.importorskip("tiktoken")
    tik = build_tokenizer(str(tiktoken_dir / "tokenizer.model"))
    template = ChatTemplate(LLAMA3_MARKED, "llama3", tik.special_tokens())
    assert _ours(tik, template, messages) == expected

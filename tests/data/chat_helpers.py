"""Hugging Face tokenizers built in-process for the chat tests: the byte tokenizer's twin and a small ChatML
(Qwen3-style) byte-level tokenizer, written as tokenizer.json + tokenizer_config.json (no network)."""

from __future__ import annotations

import json
from pathlib import Path

BYTE_SPECIALS = ["<s>", "</s>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# A Qwen3-style ChatML template with {% generation %} around what the model writes (its turn after the header).
QWEN3_STYLE_MARKED = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's own template (the published tokenizer_config.json's, tool calls left out): no generation markers, the
# last assistant turn after the last user query gets a think block, earlier ones their content only.
# QWEN3_REAL_MARKED is the same template with {% generation %} around what the model writes after its header.
_QWEN3_HEAD = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
)
_QWEN3_BODY = (
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- content }}{%- endif %}"
    "{{- '<|im_end|>' }}"
)
_QWEN3_TAIL = (
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# A Llama 3 chat template (header per message, <|eot_id|> ends each turn), with generation markers and without.
_LLAMA3_TURN = "{{- message['content'] | trim + '<|eot_id|>' }}"
_LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}ASSISTANT{%- else %}" + _LLAMA3_TURN + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_MARKED = _LLAMA3.replace("ASSISTANT", "{% generation %}" + _LLAMA3_TURN + "{% endgeneration %}")
LLAMA3_PLAIN = _LLAMA3.replace("ASSISTANT", _LLAMA3_TURN)

QWEN3_REAL = _QWEN3_HEAD + _QWEN3_BODY + _QWEN3_TAIL
QWEN3_REAL_MARKED = _QWEN3_HEAD + "{% generation %}" + _QWEN3_BODY + "{% endgeneration %}" + _QWEN3_TAIL


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_byte_level_tokenizer(folder: Path, specials: list[str], config: dict) -> Path:
    """A byte-level BPE without merges (id = byte value) plus `specials` from 256 on, and its tokenizer_config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def hf_tokenizer(folder: Path):
    """transformers' tokenizer of the folder (PreTrainedTokenizerFast, from its files only)."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    kwargs = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token") if k in cfg}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    tok.chat_template = template
    return tok

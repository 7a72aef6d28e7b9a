"""Chat data for supervised fine-tuning: records -> messages -> the tokenizer's chat template -> token ids with the
assistant-token mask.

Templates render as transformers renders them (utils/chat_template_utils.py): a jinja2 ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` block, the `tojson` filter and the
`raise_exception` / `strftime_now` / `dict` / `namespace` globals, the tokenizer's special-token strings as variables.
Nothing a template or a record brings runs outside that sandbox.

The assistant mask marks the tokens that overlap a span of assistant text (the rule of transformers'
`return_assistant_tokens_mask`). A template with `{% generation %}` blocks gives the spans itself. For one without
them (most published models' own) the span of assistant turn i begins where the conversation rendered up to turn i with
`add_generation_prompt` stops agreeing with the whole conversation (the model's turn begins after the generation
prompt), and ends after the template's end of turn: what the template writes after an assistant message's content,
trailing whitespace left out (`<|im_end|>` for ChatML), or the tokenizer's EOS when it writes nothing there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from titan_npu.data.files import BadRecords, open_input, os_error
from titan_npu.data.sources import DocumentReader, source_kind
from titan_npu.data.tokenizer import BYTE_TOKENIZER_NAMES, Tokenizer
from titan_npu.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTE_TEMPLATE = Path(__file__).parent / "chat_templates" / "byte.jinja"  # the byte tokenizer's own template
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases of a message's reasoning
_PROBE = ("\x00titan-probe-user\x00", "\x00titan-probe-assistant\x00")


class BadRecord(ValueError):
    """A record that is not a conversation (the message says why); counted and skipped, or refused, by BadRecords."""


@dataclass(frozen=True)
class RecordFormat:
    """How records hold a conversation: chat ({"messages": [...]}) or instruction (prompt / response fields)."""

    kind: str = "chat"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str = "system"


@dataclass(frozen=True)
class ChatSource:
    """How a run reads chat data: the record format, the chat template, and whether bad records are skipped."""

    fmt: RecordFormat
    template: ChatTemplate
    skip_bad_records: bool = False


def chat_source(data: Any, tokenizer: Tokenizer) -> ChatSource | None:
    """The ChatSource of a [data] section (data.format chat / instruction), None for text."""
    if data.format == "text":
        return None
    fmt = RecordFormat(data.format, data.messages_field, data.prompt_field, data.response_field, data.system_field)
    return ChatSource(fmt, load_chat_template(tokenizer, data.tokenizer, data.chat_template), data.skip_bad_records)


def messages_of(record: object, fmt: RecordFormat) -> list[dict]:
    """The messages of one record, checked: roles known, contents strings, at least one non-empty assistant turn."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, found {_describe(record)}")
    if fmt.kind == "instruction":
        messages = []
        system = record.get(fmt.system_field)
        if system is not None:
            if not isinstance(system, str):
                raise BadRecord(f"'{fmt.system_field}' is a {type(system).__name__}, not a string")
            messages.append({"role": "system", "content": system})
        for field, role in ((fmt.prompt_field, "user"), (fmt.response_field, "assistant")):
            if field not in record:
                which = "prompt" if role == "user" else "response"
                raise BadRecord(f"no '{field}' field (fields: {', '.join(sorted(record)) or 'none'}); set "
                                f"data.{which}_field (--{which}-field)")
            value = record[field]
            if not isinstance(value, str) or not value.strip():
                raise BadRecord(f"'{field}' is {_describe(value)}, not a non-empty string")
            messages.append({"role": role, "content": value})
        return messages
    if fmt.messages_field not in record:
        instruction = " or data.format = \"instruction\" (--format instruction)" \
            if fmt.prompt_field in record and fmt.response_field in record else ""
        raise BadRecord(f"no '{fmt.messages_field}' field (fields: {', '.join(sorted(record)) or 'none'}); give "
                        f"{{\"{fmt.messages_field}\": [{{\"role\": ..., \"content\": ...}}, ...]}}, or set "
                        f"data.messages_field (--messages-field){instruction}")
    messages = record[fmt.messages_field]
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"'{fmt.messages_field}' is {_describe(messages)}, not a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{fmt.messages_field}[{i}]"
        if not isinstance(message, dict):
            raise BadRecord(f"{where} is {_describe(message)}, not an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise BadRecord(f"{where} has role {role!r}; roles are {', '.join(ROLES)}")
        content = message.get("content")
        calls = message.get("tool_calls")
        if role == "assistant" and not (isinstance(content, str) and content.strip()) and not calls:
            raise BadRecord(f"{where} is an empty assistant turn (content {_describe(content)})")
        if content is not None and not isinstance(content, str):
            raise BadRecord(f"{where} content is {_describe(content)}, not a string")
        # transformers drops keys whose value is None before rendering (templates handle a missing key)
        out.append({k: v for k, v in message.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("the conversation has no assistant turn: nothing to learn from it")
    return out


_JSON_KINDS = {dict: "an object", list: "a list", bool: "a boolean", int: "a number", float: "a number"}


def _describe(value: object) -> str:
    """What a JSON value is, in the record's own terms."""
    if isinstance(value, str):
        return "an empty string" if not value.strip() else "a string"
    return "missing" if value is None else _JSON_KINDS.get(type(value), f"a {type(value).__name__}")


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """transformers' _alias_reasoning_fields: a message's reasoning under every name templates read."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


@lru_cache(maxsize=8)
def _compile(text: str) -> Any:
    """The template compiled in transformers' sandboxed environment (its extensions, filters and globals)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of what it renders."""

        tags = {"generation"}

        def __init__(self, environment: ImmutableSandboxedEnvironment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking: ContextVar = ContextVar("assistant_tracker", default=None)

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context: jinja2.nodes.EvalContext, caller: jinja2.runtime.Macro) -> str:
            rv = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """dict() without attribute access to the class."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore attributes (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(text)


class ChatTemplate:
    """A chat template and the special-token strings it renders with; render(), assistant_spans(), end_of_turn."""

    def __init__(self, text: str, where: str, special_tokens: dict[str, str]):
        import jinja2

        self.text, self.where, self.special_tokens = text, where, dict(special_tokens)
        try:
            self._template = _compile(text)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"chat template {where} is not a valid jinja2 template (line {e.lineno}: {e.message}); "
                            "fix it or set data.chat_template to another") from None
        self.has_generation = bool(_GENERATION_TAG.search(text))
        self.end_of_turn = self._end_of_turn()

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None,
               track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(text, spans of its {% generation %} blocks) of messages; BadRecord with the template's own message when
        the template raises."""
        import jinja2

        variables = {**self.special_tokens, "messages": _alias_reasoning(messages), "tools": tools,
                     "documents": None, "add_generation_prompt": add_generation_prompt}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            if not track:
                return self._template.render(**variables), spans
            with self._template.environment.activate_tracker(blocks, spans):
                for block in self._template.generate(**variables):
                    blocks.append(block)
                return "".join(blocks), spans
        except jinja2.TemplateError as e:  # raise_exception(...), an undefined call, a sandbox refusal
            raise BadRecord(f"the chat template {self.where} raised: {e.message or type(e).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise BadRecord(f"the chat template {self.where} failed on this record ({type(e).__name__}: {e})"
                            ) from None

    def assistant_spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(rendered conversation, character spans of its assistant turns); see the module doc for the rule."""
        if self.has_generation:
            return self.render(messages, tools=tools, track=True)
        text, _ = self.render(messages, tools=tools)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = _common_prefix(self._prompt_before(messages, i, tools), text)
            end = text.find(self.end_of_turn, start) if self.end_of_turn else -1
            spans.append((start, end + len(self.end_of_turn) if end >= 0 else len(text)))
        return text, spans

    def _prompt_before(self, messages: list[dict], i: int, tools: list | None) -> str:
        """messages[:i] rendered with the generation prompt; a template that cannot render no messages gives ''."""
        try:
            return self.render(messages[:i], add_generation_prompt=True, tools=tools)[0]
        except BadRecord:
            if i:
                raise
            return ""

    def _end_of_turn(self) -> str:
        """What the template writes after an assistant message's content, trailing whitespace left out; else EOS."""
        try:
            text, _ = self.render([{"role": "user", "content": _PROBE[0]}, {"role": "assistant", "content": _PROBE[1]}])
        except BadRecord:
            text = ""
        after = text.rsplit(_PROBE[1], 1)[1].rstrip() if _PROBE[1] in text else ""
        if after and _PROBE[0] not in after:
            return after
        return self.special_tokens.get("eos_token", "")


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def load_chat_template(tokenizer: Tokenizer, tokenizer_spec: str, override: str = "") -> ChatTemplate:
    """The template of data.chat_template (a .jinja file, or a tokenizer_config.json holding one), else the
    tokenizer's own (chat_template.jinja or tokenizer_config.json's chat_template beside it; the byte tokenizer's is
    shipped); DataError when there is none."""
    special = tokenizer.special_tokens()
    if override:
        path = Path(override).expanduser()
        if path.is_dir():
            text = _template_in(path)
            if text is None:
                raise DataError(f"data.chat_template {override} holds no {TEMPLATE_FILE} and no {TOKENIZER_CONFIG} "
                                "with a chat_template; point it at a .jinja file")
            return ChatTemplate(text, override, special)
        if not path.exists():
            raise DataError(f"data.chat_template {override} does not exist; point it at a .jinja file")
        if path.suffix == ".json":
            text = _template_of_config(path)
            if text is None:
                raise DataError(f"data.chat_template {override} has no 'chat_template' key; point it at a .jinja "
                                "file or a tokenizer_config.json that has one")
            return ChatTemplate(text, override, special)
        return ChatTemplate(_read_text(path), override, special)
    if tokenizer_spec in BYTE_TOKENIZER_NAMES:
        return ChatTemplate(_read_text(BYTE_TEMPLATE), "byte (shipped)", special)
    path = Path(tokenizer_spec).expanduser()
    folder = path if path.is_dir() else path.parent
    text = _template_in(folder)
    if text is None:
        raise DataError(f"tokenizer {tokenizer_spec} has no chat template ({folder} holds no {TEMPLATE_FILE} and no "
                        f"chat_template in {TOKENIZER_CONFIG}); set data.chat_template (--chat-template) to a .jinja "
                        "file")
    return ChatTemplate(text, str(folder), special)


def _template_in(folder: Path) -> str | None:
    """chat_template.jinja in folder (what transformers 5 saves), else tokenizer_config.json's chat_template."""
    if (folder / TEMPLATE_FILE).is_file():
        return _read_text(folder / TEMPLATE_FILE)
    if (folder / TOKENIZER_CONFIG).is_file():
        return _template_of_config(folder / TOKENIZER_CONFIG)
    return None


def _template_of_config(path: Path) -> str | None:
    try:
        cfg = json.loads(_read_text(path))
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); fix it") from None
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise DataError(f"{path}: 'chat_template' is a {type(template).__name__}, not a string; fix it")
    return template


def _read_text(path: Path) -> str:
    try:
        with open_input(path, "point data.chat_template at a regular .jinja file") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (at byte {e.start}); re-encode it") from None
    except OSError as e:
        raise os_error(path, e) from None


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token overlapping an assistant span (transformers' return_assistant_tokens_mask rule)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    span = 0
    for i, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[i] = 1
    return mask


def encode_conversation(messages: list[dict], template: ChatTemplate, tokenizer: Tokenizer,
                        tools: list | None = None) -> tuple[list[int], np.ndarray]:
    """(token ids, assistant mask) of one conversation; BadRecord when the template raises or keeps no assistant
    text."""
    text, spans = template.assistant_spans(messages, tools)
    ids, offsets = tokenizer.encode_chat(text)
    mask = assistant_mask(offsets, spans)
    if len(mask):
        mask[0] = 0  # nothing precedes a conversation's first token inside a packed window: it is never a label
    if not mask.any():
        raise BadRecord(f"no assistant token after rendering with the chat template {template.where} (it drops the "
                        "assistant turns?)")
    return ids, mask


class ConversationReader(DocumentReader):
    """The conversations (messages, tools) of a .jsonl / .json file of chat or instruction records."""

    def __init__(self, path: Path, fmt: RecordFormat, bad: BadRecords):
        super().__init__(path, bad=bad)
        if source_kind(path) not in ("jsonl", "json"):
            raise DataError(f"{path}: chat and instruction records are read from .jsonl or .json files; convert it")
        self.fmt = fmt

    def _text_of(self, record: object, where: str) -> tuple[str, list[dict], list | None] | None:  # type: ignore[override]
        try:
            messages = messages_of(record, self.fmt)
        except BadRecord as e:
            self.bad.report(where, str(e))
            return None
        tools = record.get("tools") if isinstance(record, dict) else None
        return where, messages, tools if isinstance(tools, list) else None


def encode_records(paths: list[Path], fmt: RecordFormat, template: ChatTemplate, tokenizer: Tokenizer,
                   bad: BadRecords) -> Iterator[tuple[list[int], np.ndarray]]:
    """(ids, assistant mask) of every good record of paths, in order; bad ones go to `bad` (refused or counted)."""
    for path in paths:
        for where, messages, tools in ConversationReader(path, fmt, bad):
            try:
                yield encode_conversation(messages, template, tokenizer, tools)
            except BadRecord as e:
                bad.report(where, str(e))

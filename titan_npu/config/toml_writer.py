"""Write a config dict as TOML: one [section] per table, scalars and flat lists only (all a config holds)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from titan_npu.errors import ConfigError

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def dumps_toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    """Render section -> key -> value as TOML; None values are left out (TOML has no null, and None is the default)."""
    blocks = []
    for section, table in data.items():
        lines = [f"[{section}]"]
        lines += [f"{key} = {_value(value, f'{section}.{key}')}" for key, value in table.items()
                  if value is not None and not _tables(value)]
        blocks.append("\n".join(lines))
        for key, value in table.items():  # a list of tables ([[data.sources]]) after the section's own keys
            if value and _tables(value):
                blocks += [dumps_toml({f"[{section}.{key}]": item}).strip().replace(f"[[[{section}.{key}]]]",
                                                                                      f"[[{section}.{key}]]")
                           for item in value]
    return "\n\n".join(blocks) + "\n"


def _tables(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item, where) for item in value) + "]"
    raise ConfigError(f"{where} = {value!r} cannot be written to TOML (use numbers, strings, booleans or lists)")


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, everything else as is."""
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'

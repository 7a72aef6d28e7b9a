"""Turn values from TOML, YAML or the command line into the schema's types, or say exactly why not."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin, get_type_hints

from titan_npu.config.schema import JobConfig
from titan_npu.errors import ConfigError
from titan_npu.knobs import SHOWN_CHARS, show  # noqa: F401  (config.coerce.show, as the loader and tests name it)

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
NULL_WORDS = ("none", "null")


class Flag:
    """A command-line key given without a value (`--compile.enable`): true for a bool, an error otherwise."""

    def __repr__(self) -> str:
        return "<flag without value>"


FLAG = Flag()


@functools.cache
def section_types() -> dict[str, type]:
    """Section name -> its dataclass, in the order of JobConfig."""
    return dict(get_type_hints(JobConfig))


@functools.cache
def field_types(section: str) -> dict[str, Any]:
    """Key -> resolved type annotation for one section (the annotations are strings until resolved)."""
    cls = section_types()[section]
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def key_types(section: str) -> dict[str, Any]:
    """field_types, and for [model] also every family's own keys (their types from the families' rows, each
    `| None`: unset takes the flavor's value); the families' keys need the model registry (it imports torch)."""
    if section != "model":
        return field_types(section)
    from titan_npu.config.options import model_key_rows

    own = {name.split(".", 1)[1]: next(iter(rows.values())).kind for name, rows in model_key_rows().items()}
    return {**field_types(section), **{key: kind | None for key, kind in own.items()}}


def type_name(hint: Any) -> str:
    """'an int', 'a float', 'a list of floats' ... for messages."""
    inner = _optional_inner(hint)
    if inner is not None:
        return type_name(inner)
    if get_origin(hint) is list:
        (elem,) = get_args(hint) or (Any,)
        return f"a list of {getattr(elem, '__name__', 'value')}s"
    name = getattr(hint, "__name__", str(hint))
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def coerce(value: Any, hint: Any, label: str) -> Any:
    """Return `value` as type `hint`; raise ConfigError('<label> = <value> is not <type>') when it cannot be."""
    inner = _optional_inner(hint)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in NULL_WORDS):
            return None
        return coerce(value, inner, label)
    if value is FLAG:
        if hint is bool:
            return True
        raise ConfigError(f"--{label} needs a value (write --{label} VALUE or --{label}=VALUE)")
    if hint is bool:
        return _to_bool(value, label)
    if hint is int:
        return _to_int(value, label)
    if hint is float:
        return _to_float(value, label)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{label} = {show(value)} is not a str (write it in quotes)")
    if get_origin(hint) is list:
        return _to_list(value, get_args(hint)[0], hint, label)
    if dataclasses.is_dataclass(hint):
        return _to_table(value, hint, label)
    raise TypeError(f"the schema type {hint!r} of {label} has no coercion rule")


def _optional_inner(hint: Any) -> Any:
    """T for `T | None`, else None."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(get_args(hint)) == 2:
            return args[0]
    return None


def _to_bool(value: Any, label: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ConfigError(f"{label} = {show(value)} is not a bool (use true/false, 1/0 or yes/no)")


def _to_int(value: Any, label: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{label} = {show(value)} is not an int")
    if isinstance(value, int):
        return value
    number: float | None = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)  # "1e5" is a common way to write 100000
        except ValueError:
            number = None
    if number is not None and math.isfinite(number) and number.is_integer():
        return int(number)
    raise ConfigError(f"{label} = {show(value)} is not an int")


def _to_float(value: Any, label: str) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None:
        raise ConfigError(f"{label} = {show(value)} is not a float")
    if not math.isfinite(number):
        raise ConfigError(f"{label} = {show(value)} is not a finite number; give a finite value such as 1.0")
    return number


def _to_list(value: Any, elem: Any, hint: Any, label: str) -> list:
    if dataclasses.is_dataclass(elem):
        return _to_tables(value, elem, label)
    if isinstance(value, str):
        items: list[Any] | None = _split_list(value)
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = None
    if items is not None:
        try:
            return [coerce(item, elem, label) for item in items]
        except ConfigError:
            pass
    raise ConfigError(f"{label} = {show(value)} is not {type_name(hint)} (write a,b or [a, b])")


def _split_list(text: str) -> list[str] | None:
    """'0.9,0.95' or '[0.9, 0.95]' -> ['0.9', '0.95']; None when an item is empty. Plain splitting, never eval."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    if not text:
        return []
    items = [item.strip() for item in text.split(",")]
    items = [item[1:-1] if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"" else item for item in items]
    return None if any(item == "" for item in items) else items


def _to_tables(value: Any, elem: type, label: str) -> list:
    """A list of tables ([[data.sources]]); a string or a list of plain values is Megatron's 'WEIGHT PATH ...'."""
    from titan_npu.config.mixture import parse_megatron

    if isinstance(value, (list, tuple)) and not any(isinstance(v, (dict, Mapping)) or dataclasses.is_dataclass(v)
                                                     for v in value):
        value = " ".join(str(v) for v in value)
    if isinstance(value, str):
        value = parse_megatron(value, label)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{label} = {show(value)} is not a list of tables (write [[{label.split(': ')[-1]}]] "
                          "tables, or 'WEIGHT PATH WEIGHT PATH ...')")
    return [_to_table(item, elem, f"{label}[{i}]") for i, item in enumerate(value)]


def _to_table(value: Any, cls: type, label: str) -> Any:
    """One table of a list of tables, each key typed; an unknown key is refused with the known ones."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{label} = {show(value)} is not a table (give its keys, e.g. path = \"...\")")
    hints = get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, item in value.items():
        if str(key) not in known:
            raise ConfigError(f"{label}: unknown key {str(key)!r} (use {', '.join(known)})")
        out[str(key)] = coerce(item, hints[str(key)], f"{label}.{key}")
    return cls(**out)

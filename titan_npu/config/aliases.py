"""Dialects: the spellings of the Ascend guides and the command line, mapped onto the canonical schema names.

`canonicalize(raw, source)` takes one parsed source (a file or the CLI overrides) and returns its values under
canonical `section -> key` names, refusing unknown names (with the closest valid one) and an alias that
disagrees with its canonical key.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from titan_npu.config.coerce import coerce, field_types, key_types, section_types, show
from titan_npu.errors import ConfigError

# [distributed] in the TOML guide is our [parallel].
SECTION_ALIASES: dict[str, str] = {"distributed": "parallel"}

# Top-level keys: the YAML guide's `dtype` and the CLI's directory flags.
TOP_LEVEL_ALIASES: dict[str, tuple[str, str]] = {
    "dtype": ("training", "dtype"),
    "data_dir": ("data", "path"),
    "data_path": ("data", "sources"),  # Megatron's --data-path "0.7 /data/web 0.3 /data/code"
    "checkpoint_dir": ("checkpoint", "dir"),
    "log_dir": ("metrics", "log_dir"),
}

# (section, alias) -> (section, canonical key); the section is the canonical one (after SECTION_ALIASES).
KEY_ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("model", "d_model"): ("model", "dim"),
    ("training", "learning_rate"): ("optimizer", "lr"),
    ("training", "weight_decay"): ("optimizer", "weight_decay"),
    ("training", "steps"): ("training", "max_steps"),
    ("training", "local_batch_size"): ("training", "batch_size"),
    ("parallel", "dp_degree"): ("parallel", "dp_shard"),
    ("parallel", "tp_size"): ("parallel", "tp_degree"),
    ("parallel", "pp_size"): ("parallel", "pp_degree"),
    ("checkpoint", "max_keep"): ("checkpoint", "keep_last_n"),
    ("checkpoint", "interval"): ("checkpoint", "save_interval"),
    ("checkpoint", "folder"): ("checkpoint", "dir"),
    ("metrics", "log_freq"): ("metrics", "log_interval"),
}

# A table nested in a section that stands for a whole section: the YAML guide's training.checkpoint.
SUBSECTION_ALIASES: dict[tuple[str, str], str] = {("training", "checkpoint"): "checkpoint"}

def normalize_flavor(flavor: str) -> str:
    """'7b' -> '7B', '3.1-8b' -> '3.1-8B', 'Debug' -> 'debug', 'Debug-Dense' -> 'debug-dense': flavors are matched
    case-insensitively."""
    flavor = flavor.strip()
    return flavor.lower() if flavor.lower().split("-")[0] == "debug" else flavor.upper()


def canonicalize(
    raw: Mapping[str, Any], source: str
) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str]]:
    """Map one source's names onto canonical ones; returns (section -> key -> value, (section, key) -> spelling)."""
    values: dict[str, dict[str, Any]] = {}
    spelled: dict[tuple[str, str], str] = {}

    def put(section: str, key: str, value: Any, spelling: str) -> None:
        table = values.setdefault(section, {})
        if key in table and not _same(table[key], value, section, key):
            first = spelled[(section, key)]
            raise ConfigError(
                f"{source}: '{first}' = {show(table[key])} and '{spelling}' = {show(value)} set the same "
                f"setting ({section}.{key}) differently; keep one of them"
            )
        table[key] = value
        spelled.setdefault((section, key), spelling)

    def put_section(section: str, spelling: str, table: Any) -> None:
        if table is None:
            return  # a YAML section whose keys are all commented out
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"{source}: '{spelling}' is a section and needs keys under it, not the value {show(table)} "
                f"(write [{spelling}] in TOML or '{spelling}:' with indented keys in YAML)"
            )
        known = field_types(section)
        for key, value in table.items():
            key = str(key)
            path = f"{spelling}.{key}"
            if (section, key) in SUBSECTION_ALIASES:
                put_section(SUBSECTION_ALIASES[(section, key)], path, value)
            elif key in known:
                put(section, key, value, path)
            elif (section, key) in KEY_ALIASES:
                put(*KEY_ALIASES[(section, key)], value, path)
            elif section == "model" and key in key_types(section):
                put(section, key, value, path)  # some family's own key: validate() checks it is this family's
            else:
                raise ConfigError(f"{source}: unknown key '{path}'{_suggest_key(section, spelling, key)}")

    for name, value in raw.items():
        name = str(name)
        if name in TOP_LEVEL_ALIASES:
            put(*TOP_LEVEL_ALIASES[name], value, name)
        elif SECTION_ALIASES.get(name, name) in section_types():
            put_section(SECTION_ALIASES.get(name, name), name, value)
        elif isinstance(value, Mapping):
            raise ConfigError(f"{source}: unknown section '{name}'{_suggest_section(name)}")
        else:
            raise ConfigError(f"{source}: unknown key '{name}'{_suggest_top_level(name)}")

    if "model" in values:
        _resolve_model_name(values["model"], spelled)
    return values, spelled


def _resolve_model_name(model: dict[str, Any], spelled: dict[tuple[str, str], str]) -> None:
    """A sized name sets the family and, unless flavor is given, the flavor; plain 'llama' is Llama 2
    (models/registry.py knows every family's spellings)."""
    from titan_npu.models.registry import parse_model_name  # imports torch: only when a [model] is read

    name = model.get("name")
    if not isinstance(name, str):
        return
    family, size = parse_model_name(name)
    if family is None:
        return  # validate() names the known families
    model["name"] = family
    if "flavor" in model:
        return
    if size is None:
        size = _published_size(family, model.get("dim"), model.get("n_layers"))
    if size is not None:
        model["flavor"] = size
        spelled[("model", "flavor")] = spelled[("model", "name")]


def _published_size(family: str, dim: Any, n_layers: Any) -> str | None:
    from titan_npu.models.registry import published_flavor

    try:
        shape = (coerce(dim, int, "model.dim"), coerce(n_layers, int, "model.n_layers"))
    except ConfigError:
        return None  # the type error is reported when the section is built
    return published_flavor(family, *shape)


def _same(a: Any, b: Any, section: str, key: str) -> bool:
    """Equal once both are read as the key's type ('3e-4' and 0.0003 agree)."""
    hint = key_types(section)[key]
    try:
        return coerce(a, hint, key) == coerce(b, hint, key)
    except ConfigError:
        return a == b


def known_keys(section: str) -> list[str]:
    """Canonical keys of a section followed by the aliases accepted in it."""
    keys = list(key_types(section))
    keys += [alias for (sec, alias) in KEY_ALIASES if sec == section]
    keys += [sub for (sec, sub) in SUBSECTION_ALIASES if sec == section]
    return keys


def _hint(candidate: str | None) -> str:
    return f" (did you mean '{candidate}'?)" if candidate else " (see docs/config.md for the valid keys)"


def _suggest_key(section: str, spelling: str, key: str) -> str:
    # A key put in the wrong section (training.lr -> optimizer.lr) is a likelier slip than a typo.
    elsewhere = [other for other in section_types() if key in field_types(other)]
    if len(elsewhere) == 1:
        return _hint(f"{elsewhere[0]}.{key}")
    if elsewhere:
        return f" ('{key}' is a key of the sections {', '.join(elsewhere)})"
    close = difflib.get_close_matches(key, known_keys(section), n=1)
    return _hint(f"{spelling}.{close[0]}" if close else _closest_path(key))


def _suggest_section(name: str) -> str:
    close = difflib.get_close_matches(name, [*section_types(), *SECTION_ALIASES], n=1)
    return _hint(close[0] if close else None)


def _suggest_top_level(name: str) -> str:
    close = difflib.get_close_matches(name, list(TOP_LEVEL_ALIASES), n=1)
    return _hint(close[0] if close else _closest_path(name))


def _closest_path(key: str) -> str | None:
    """The canonical `section.key` whose key or alias is closest to `key`, across every section."""
    paths = {k: f"{section}.{k}" for section in section_types() for k in field_types(section)}
    for (_, alias), target in KEY_ALIASES.items():
        paths.setdefault(alias, ".".join(target))
    close = difflib.get_close_matches(key, list(paths), n=1)
    return paths[close[0]] if close else None

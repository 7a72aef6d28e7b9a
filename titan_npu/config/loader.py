"""Load a JobConfig from a TOML/YAML file plus command-line overrides, and write one back.

Pure: reads the one file it is given, nothing from the environment, and writes nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from titan_npu.atomic import atomic_write_bytes
from titan_npu.config.aliases import canonicalize
from titan_npu.config.coerce import FLAG, coerce, key_types, section_types
from titan_npu.config.schema import JobConfig
from titan_npu.config.toml_writer import dumps_toml
from titan_npu.config.validate import validate
from titan_npu.errors import ConfigError
from titan_npu.regular_files import NotRegularFile, read_regular_bytes, read_regular_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SUFFIXES = (".toml", ".yaml", ".yml")
CLI = "command line"


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = (), model: bool = True) -> JobConfig:
    """Defaults, then the file at `path` (None: none), then `overrides` (--section.key value ...); validated.

    model=False reads every section but [model], which stays at its defaults, unread and unchecked: that much is
    read without importing torch (the model registry, which resolves [model], imports it), for the launcher to set
    the variables torch_npu reads at import before torch imports it (titan_npu/train.py).
    """
    if isinstance(overrides, str):
        raise TypeError("overrides is a sequence of command-line tokens, e.g. ['--model.dim', '64'], not one string")
    sources: list[tuple[str, Mapping[str, Any]]] = []
    lines: dict[str, list[str]] = {}
    if path is not None:
        data = read_config_file(path)
        if not _sets_a_key(data):
            raise ConfigError(f"config file '{path}' sets nothing (it is empty or holds only comments and section "
                              "headers); write the keys to change under their sections, e.g. [training] max_steps = "
                              "100, or leave out --config to run on the defaults")
        sources.append((str(path), data))
        lines[str(path)] = read_regular_text(path, "utf-8-sig").splitlines()
    if overrides:
        sources.append((CLI, parse_overrides(overrides)))
    if not model:
        sources = [(source, {k: v for k, v in raw.items() if k != "model"}) for source, raw in sources]
    return _build(sources, lines, model)


def _sets_a_key(data: Mapping[str, Any]) -> bool:
    """True when a parsed config file holds at least one key with a value (not only empty sections; YAML reads a
    section whose keys are all commented out as null)."""
    return any(_sets_a_key(v) if isinstance(v, Mapping) else v is not None for v in data.values())


def config_from_dict(data: Mapping[str, Any], source: str = "config") -> JobConfig:
    """A validated JobConfig from a nested dict (canonical or alias names); `source` names it in errors."""
    return _build([(source, data)])


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as a nested plain dict under canonical names (lists copied); [model] lists name and flavor, the
    family's own keys that are set (in the family's order), then the shared switches."""
    data = dataclasses.asdict(cfg)
    model = cfg.model
    order = list(model.keys)
    if model.keys:
        from titan_npu.models.registry import SPECS  # the family's key order (imports torch)

        spec = SPECS.get(model.name)
        if spec is not None:
            order.sort(key=lambda key: list(spec.model_keys).index(key) if key in spec.model_keys else len(order))
    shared = data["model"]
    data["model"] = {"name": shared.pop("name"), "flavor": shared.pop("flavor"),
                     **{key: copy.deepcopy(model.keys[key]) for key in order}, **shared}
    return data


def save_config(cfg: JobConfig, path: str | os.PathLike[str]) -> None:
    """Write `cfg` to `path`: TOML if it ends in .toml, else YAML. Atomic: a reader sees the old file or the new."""
    data = config_to_dict(cfg)
    target = Path(path)
    if target.suffix.lower() == ".toml":
        text = dumps_toml(data)
    else:
        try:
            text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot write {target} as YAML: {_one_line(str(e))}") from None
    try:
        payload = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"cannot write {target}: a value holds text that is not valid Unicode ({e.reason})") from None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, payload)
    except OSError as e:
        raise ConfigError(f"cannot write {target}: {e.strerror or e} (choose a writable path)") from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a .toml/.yaml/.yml file into a dict; every failure is a one-line ConfigError naming the file."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"config file '{path}' has the unsupported extension '{file.suffix or '(none)'}' (use .toml, .yaml or .yml)"
        )
    if not file.exists():
        raise ConfigError(f"config file '{path}' not found (check the path given to --config)")
    if file.is_dir():
        raise ConfigError(f"config file '{path}' is a directory (give the .toml or .yaml file inside it)")
    try:
        raw = read_regular_bytes(file)
        # utf-8-sig: a byte-order mark (which some Windows editors write) is dropped, as PyYAML drops it.
        text = raw.decode("utf-8-sig")
    except NotRegularFile as e:
        raise ConfigError(f"config file '{path}' is {e.kind}, not a regular file; give the .toml or .yaml file "
                          "itself (copy what a pipe brings into a file first)") from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save "
                          f"the file as UTF-8") from None
    try:
        data = _parse_toml(text, path) if suffix == ".toml" else _parse_yaml(text, path)
    except RecursionError:  # the parsers recurse once per level of [[[...]]] / {{...}}
        raise ConfigError(f"{path}: values nested too deeply (lists or tables inside each other hundreds of levels "
                          f"deep); a config is a few levels deep: check the file's brackets") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not a {type(data).__name__}")
    return data


def _parse_toml(text: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message already ends with "(at line L, column C)".
        raise ConfigError(f"{path}: invalid TOML: {_one_line(_name_the_duplicate(str(e), text))}") from None


_AT = re.compile(r"\(at line (\d+), column \d+\)$")
_HEADER = re.compile(r"\s*\[\[?\s*([^\]]+?)\s*\]\]?")


def _name_the_duplicate(message: str, text: str) -> str:
    """tomllib's 'Cannot overwrite a value (at line L, ...)' names no key: say which key (or table) line L sets
    again, and in which table, so the user knows what to keep."""
    at = _AT.search(message)
    declared = re.match(r"Cannot declare \((.*)\) twice", message)
    if declared and at is not None:
        name = ".".join(part.strip().strip("'\"") for part in declared.group(1).split(",") if part.strip())
        return f"table [{name}] is declared twice (the second time at line {at.group(1)}); merge the two into one"
    if not message.startswith("Cannot overwrite a value") or at is None:
        return message
    lines = text.splitlines()
    number = int(at.group(1))
    if not 1 <= number <= len(lines):
        return message
    line = lines[number - 1]
    header = _HEADER.match(line)
    if header:
        return f"table [{header.group(1)}] at line {number} redefines a key that already holds a value; rename one"
    key = line.split("=", 1)[0].strip()
    table = next((m.group(1) for m in map(_HEADER.match, reversed(lines[:number - 1])) if m), None)
    where = f" in [{table}]" if table else ""
    return f"key {key}{where} is set twice (the second time at line {number}); keep one"


# The most values a YAML config may expand to once its aliases (*name) are followed: a real config has hundreds; an
# alias bomb ("billion laughs": each list nine aliases of the one before) has billions and would hang the run.
MAX_YAML_VALUES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last), and a document
    whose aliases expand it past MAX_YAML_VALUES values (counted on the node graph before anything is built)."""

    def construct_document(self, node: yaml.Node) -> Any:
        if _expanded_size(node, {}, set()) > MAX_YAML_VALUES:
            raise yaml.constructor.ConstructorError(
                None, None, f"its aliases (*name) expand it past the {MAX_YAML_VALUES:,} values a config may hold "
                f"(an alias bomb, or an alias inside its own anchor); write the values out or use fewer aliases",
                node.start_mark)
        return super().construct_document(node)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Values in `node` with every alias followed (a shared node counted each time it is reached), computed once per
    node, so in time linear in the file; a node that contains itself counts as too many."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        return MAX_YAML_VALUES + 1  # a recursive alias: expanding it never ends
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_VALUES:
            break
    open_nodes.discard(key)
    sizes[key] = total
    return total


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` merges; its keys may be overridden on purpose
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a plain value, not {type(key).__name__}", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' is given twice (keep one)", key_node.start_mark
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=True))


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _parse_yaml(text: str, path: str | os.PathLike[str]) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: plain data, no object tags
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"{context}: {problem}" if context else problem
        raise ConfigError(f"{path}: invalid YAML{where}: {_one_line(detail)}") from None


_MANY_TOKENS = ("data_path", "data.sources")  # keys whose value may be several tokens: 'WEIGHT PATH WEIGHT PATH ...'


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """['--model.dim', '64', '--compile.enable', '--x.y=z'] -> {'model': {'dim': '64'}, 'compile': {...}, ...}.

    Values stay strings (the schema types them later); a key followed by nothing or by another --key is a flag.
    """
    raw: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = str(tokens[i])
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"{CLI}: unexpected argument '{token}' (overrides look like --section.key VALUE or --section.key=VALUE)"
            )
        body = token[2:]
        if "=" in body:
            name, value = body.split("=", 1)
            i += 1
        elif body.replace("-", "_") in _MANY_TOKENS:  # Megatron's --data-path 0.7 /data/web 0.3 /data/code
            end = next((j for j in range(i + 1, len(tokens)) if str(tokens[j]).startswith("--")), len(tokens))
            name, value = body, " ".join(str(t) for t in tokens[i + 1 : end]) if end > i + 1 else FLAG
            i = end
        elif i + 1 < len(tokens) and not str(tokens[i + 1]).startswith("--"):
            name, value = body, str(tokens[i + 1])
            i += 2
        else:
            name, value = body, FLAG
            i += 1
        _set_path(raw, name, value, token)
    return raw


def _set_path(raw: dict[str, Any], name: str, value: Any, token: str) -> None:
    # Flags are often written with dashes (--checkpoint-dir); schema names use underscores.
    parts = [part.replace("-", "_") for part in name.split(".")]
    if any(not part for part in parts):
        raise ConfigError(f"{CLI}: malformed override '{token}' (write --section.key VALUE)")
    table = raw
    for depth, part in enumerate(parts[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            prefix = ".".join(parts[: depth + 1])
            raise ConfigError(f"{CLI}: '{prefix}' is given both a value and keys under it ({token}); keep one")
    table[parts[-1]] = value


def _build(sources: Sequence[tuple[str, Mapping[str, Any]]], lines: Mapping[str, list[str]] | None = None,
           model: bool = True) -> JobConfig:
    """Canonicalise and type every value of each source (a file's value is checked even when the command line
    overrides it), let later sources win key by key, validate. `lines`: a file source's text, to name lines."""
    lines = lines or {}
    merged: dict[str, dict[str, Any]] = {}
    origin: dict[tuple[str, str], tuple[str, str]] = {}  # (section, key) -> (where: source[:line], spelling)
    for source, raw in sources:
        values, spelled = canonicalize(raw, source)
        for section, table in values.items():
            types_ = key_types(section)
            for key, value in table.items():
                spelling = spelled[(section, key)]
                line = _line_of(lines.get(source, []), spelling)
                where = f"{source}:{line}" if line else source
                label = spelling if value is FLAG else f"{where}: {spelling}"
                try:
                    merged.setdefault(section, {})[key] = coerce(value, types_[key], label)
                except ConfigError as e:
                    # A flag without its value reads best with the source in front: "command line: --x.y needs..."
                    raise (ConfigError(f"{source}: {e}") if value is FLAG else e) from None
                origin[(section, key)] = (where, spelling)
                _one_data_input(merged, origin, section, key, where)

    sections = {section: cls(**merged.get(section, {})) for section, cls in section_types().items()}
    cfg = JobConfig(**sections)

    try:
        return validate(cfg, model)
    except ConfigError as e:
        key = getattr(e, "key", None)
        if key is None or tuple(key.split(".", 1)) not in origin:
            raise
        where, spelling = origin[tuple(key.split(".", 1))]  # type: ignore[index]
        note = f" (set as '{spelling}')" if spelling != key else ""
        raise ConfigError(f"{where}: {e}{note}") from None


def _one_data_input(merged: dict[str, dict[str, Any]], origin: dict, section: str, key: str, where: str) -> None:
    """data.path and data.sources name the run's data two ways: a later source setting one drops what an earlier
    source set for the other (a file's data.path, then --data_path "0.7 web 0.3 code" on the command line)."""
    other = {"path": "sources", "sources": "path"}.get(key) if section == "data" else None
    if other is None or not merged["data"][key]:
        return
    earlier = origin.get(("data", other))
    if earlier is not None and earlier[0].split(":")[0] != where.split(":")[0]:
        merged["data"].pop(other, None)
        origin.pop(("data", other))


def _line_of(text: list[str], spelling: str) -> int | None:
    """The line (1-based) of a TOML or YAML file that sets `spelling` (section.key as written), if one clearly does:
    the key's line under its section's header, or the only line setting that key anywhere."""
    *tables, key = spelling.split(".")
    key_line = re.compile(rf"""^\s*["']?{re.escape(key)}["']?\s*[=:]""")
    header = None  # the current TOML [table] or top-level YAML mapping key
    under, anywhere = [], []
    for number, line in enumerate(text, 1):
        stripped = line.strip()
        toml_header = re.fullmatch(r"\[\s*([^\[\]]+?)\s*\]\s*(#.*)?", stripped)
        if toml_header:
            header = toml_header.group(1).replace(" ", "")
            continue
        yaml_header = re.fullmatch(r"([A-Za-z_][\w-]*)\s*:\s*(#.*)?", line.rstrip())
        if yaml_header:
            header = yaml_header.group(1)
            continue
        if key_line.match(line):
            anywhere.append(number)
            if header is not None and tables and header in (".".join(tables), tables[0]):
                under.append(number)
            elif not tables and header is None:
                under.append(number)
    if len(under) == 1:
        return under[0]
    return anywhere[0] if len(anywhere) == 1 else None


def _one_line(text: str) -> str:
    return " ".join(text.split())

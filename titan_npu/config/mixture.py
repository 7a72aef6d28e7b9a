"""A data mixture's sources as the config gives them: Megatron's one-line spelling, default names, the checks.

`data.path` alone is a mixture of one source; `[[data.sources]]` (or `--data_path "0.7 /data/web 0.3 /data/code"`)
names several, each with its own weight. What the loader does with them lives in data/mixture.py.
"""

from __future__ import annotations

import math
from pathlib import PurePath

from titan_npu.config.schema import DataConfig, DataSource
from titan_npu.errors import ConfigError

MEGATRON_FORM = "'WEIGHT PATH WEIGHT PATH ...' (e.g. \"0.7 /data/web 0.3 /data/code\") or one PATH"


def parse_megatron(text: str, label: str) -> list[dict]:
    """'0.7 /data/web 0.3 /data/code' (Megatron's --data-path) or a lone path -> source tables (names default later)."""
    tokens = text.replace(",", " ").split()
    if not tokens:
        return []
    if len(tokens) == 1 and not _is_number(tokens[0]):
        return [{"path": tokens[0]}]
    if len(tokens) % 2:
        raise ConfigError(f"{label} = {text!r} has {len(tokens)} items, not weight/path pairs; write {MEGATRON_FORM}")
    sources = []
    for weight, path in zip(tokens[0::2], tokens[1::2]):
        if not _is_number(weight):
            raise ConfigError(f"{label} = {text!r}: {weight!r} stands where a weight belongs; write {MEGATRON_FORM}")
        if _is_number(path):
            raise ConfigError(f"{label} = {text!r}: {path!r} stands where a path belongs; write {MEGATRON_FORM}")
        sources.append({"path": path, "weight": weight})
    return sources


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def default_name(path: str) -> str:
    """A source's name from its path: the folder's or file's name without extensions ('' = the built-in corpus)."""
    if not path:
        return "builtin"
    name = PurePath(path.rstrip("/\\") or path).name
    return name.split(".")[0] or name


def sources_of(data: DataConfig) -> list[DataSource]:
    """The run's sources, names and text fields filled in and weights normalised; data.path alone is one source."""
    given = data.sources or [DataSource(path=data.path)]
    total = sum(s.weight for s in given)
    return [DataSource(name=s.name or default_name(s.path), path=s.path, weight=s.weight / total,
                       text_field=s.text_field or data.text_field, max_epochs=s.max_epochs) for s in given]


def check_sources(data: DataConfig) -> None:
    """ConfigError for a mixture no loader could draw from: a bad weight, a name twice, no path, max_epochs < 0."""
    if not data.sources:
        return
    if data.path:
        raise ConfigError(f"data.path = {data.path!r} and data.sources are both set; keep data.sources (a mixture) "
                          "or data.path (one source), not both")
    names: dict[str, int] = {}
    for i, s in enumerate(data.sources):
        where = f"data.sources[{i}]" + (f" ({s.name})" if s.name else "")
        if not math.isfinite(s.weight) or s.weight < 0:
            raise ConfigError(f"{where}.weight = {s.weight} must be a finite number >= 0 (weights are normalised "
                              "over the sources)")
        if s.max_epochs < 0:
            raise ConfigError(f"{where}.max_epochs = {s.max_epochs} must be >= 0 (0 = no limit)")
        name = s.name or default_name(s.path)
        if name in names:
            raise ConfigError(f"data.sources[{names[name]}] and data.sources[{i}] are both named {name!r}; give each "
                              "source its own name (name = \"...\")")
        names[name] = i
        if "/" in name or not name.strip():
            raise ConfigError(f"{where}.name = {name!r} must be a plain word (it names metrics: tokens/<name>)")
    if sum(s.weight for s in data.sources) <= 0:
        raise ConfigError("data.sources: every weight is 0; give at least one source a weight > 0")

"""A model family owns its names and its own fields: no module outside titan_npu/models/ names either.

The trainer, parallel/, the planner, checkpoints, commands and tools reach a family only through its ModelSpec
(models/spec.py: its cost terms, its printed [model] keys, its refusals), so a new family is its folder plus one
registry line. Grep-level: a family's name (the registry's model.name, any case) or a field of its args dataclass
that no other family's args have, as a whole word anywhere in a module outside models/ (code, comment or string),
fails. Both lists are derived, not written down: the names from the registry, the fields by comparing the args
dataclasses of every family's first flavor.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

from titan_npu.models.registry import SPECS

PACKAGE = Path(__file__).resolve().parents[2] / "titan_npu"

def family_names() -> set[str]:
    """Every family's model.name."""
    return set(SPECS)


def family_only_fields() -> dict[str, set[str]]:
    """family -> the fields of its args dataclass that no other family's args dataclass has (families that share
    one dataclass, e.g. the dense decoders, share its fields: none of them is family-only)."""
    fields = {}
    for name, spec in SPECS.items():
        flavor = next(iter(spec.flavors))
        args = spec.args_from_dict({**spec.flavors[flavor], "family": name})
        fields[name] = (type(args), {f.name for f in dataclasses.fields(args)})
    own = {}
    for name, (kind, names) in fields.items():
        others = set().union(*(f for other, (k, f) in fields.items() if k is not kind))
        own[name] = names - others
    return own


def _pattern(words: Iterable[str], ignore_case: bool) -> re.Pattern:
    alternatives = "|".join(sorted(map(re.escape, words), key=len, reverse=True))
    return re.compile(rf"(?<![A-Za-z0-9_])(?:{alternatives})(?![A-Za-z0-9_])", re.IGNORECASE if ignore_case else 0)


def violations(paths: Iterable[Path], root: Path) -> list[str]:
    """'file:line: word (what it is)' for each family name or family-only field that `paths` name."""
    names = _pattern(family_names(), ignore_case=True)
    owner = {f: family for family, fs in family_only_fields().items() for f in fs}
    fields = _pattern(owner, ignore_case=False)
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(root)}:{number}"
            found += [f"{where}: {m.group(0)} (a family's name)" for m in names.finditer(line)]
            found += [f"{where}: {m.group(0)} ({owner[m.group(0)]}'s own field)" for m in fields.finditer(line)]
    return found


def _outside_models() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] != "models"]


# The one family a framework file may name: the schema's default model.name (a run with no [model] trains it).
_DEFAULT_NAME = "config/schema.py", "llama3"


def test_no_module_outside_models_names_a_family_or_a_family_only_field():
    from titan_npu.config.schema import ModelConfig

    assert ModelConfig().name == _DEFAULT_NAME[1]
    found = [v for v in violations(_outside_models(), PACKAGE)
             if not (v.startswith(f"{_DEFAULT_NAME[0]}:") and v.endswith(f": {_DEFAULT_NAME[1]} (a family's name)"))]
    assert not found, ("modules outside titan_npu/models/ name a model family or one family's own field; reach the "
                       "family through its ModelSpec (models/spec.py) instead:\n" + "\n".join(found))


def test_the_derived_lists_hold_each_familys_own_fields_and_catch_a_use(tmp_path):
    own = family_only_fields()
    assert set(own) == family_names()
    # A field two families' dataclasses share is nobody's own (a family that shares its dataclass has none);
    # some family adds fields of its own.
    assert "dim" not in set().union(*own.values()) and any(own.values())
    family, fields = next((family, fs) for family, fs in own.items() if fs)
    planted = tmp_path / "planted.py"
    planted.write_text(f"x = args.{sorted(fields)[0]}\n# a {family.upper()} model\nwidth = args.dim\n")
    found = violations([planted], tmp_path)
    assert len(found) == 2 and found[0].startswith("planted.py:1: ") and found[1].startswith("planted.py:2: ")

"""A data mixture's accounting: tokens seen per source and its share, in the records and on the console line."""

from __future__ import annotations

from typing import Any

TOKENS, SHARE = "tokens/", "share/"


def mixture_record(source_tokens: dict[str, int]) -> dict[str, Any]:
    """tokens/<name> and share/<name> (of the tokens all sources gave) for each source; {} for one source."""
    total = sum(source_tokens.values())
    if len(source_tokens) < 2 or total <= 0:
        return {}
    record: dict[str, Any] = {f"{TOKENS}{name}": n for name, n in source_tokens.items()}
    record.update({f"{SHARE}{name}": n / total for name, n in source_tokens.items()})
    return record


def shares(record: dict[str, Any]) -> dict[str, float]:
    """Source name -> share of a record (empty without a mixture)."""
    return {k[len(SHARE):]: v for k, v in record.items() if k.startswith(SHARE) and isinstance(v, (int, float))}


def format_mix(record: dict[str, Any]) -> str:
    """'mix=web 60%/code 30%/math 10%' for a record of two or more sources, else ''."""
    s = shares(record)
    if len(s) < 2:
        return ""
    return "mix=" + "/".join(f"{name} {100 * v:.0f}%" for name, v in s.items())

"""The rows of the knob table: what a value may be (a range of numbers, choices, non-empty), and the one-line refusal
of a value outside it. config/options.py holds the table of every config key and command option; a model family
declares its own [model] keys' rows in its folder (models/<family>/args.py). Imports nothing of config/ or models/,
so both can build on it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from titan_npu.errors import ConfigError

SHOWN_CHARS = 200  # a longer value is cut in a message, which stays one readable line


def show(value: Any) -> str:
    """A value as a person would write it in a config: strings quoted, booleans and null lower case; past
    SHOWN_CHARS characters, its start and how long it is."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    if len(text) > SHOWN_CHARS:
        return f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"
    return text


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Range:
    """An interval of numbers (either end open or absent), plus single values allowed outside it (0 = off)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # > low rather than >= low
    high_open: bool = False  # < high rather than <= high
    also: tuple[tuple[float, str], ...] = ()  # (value, what it means) accepted besides the interval

    def allows(self, value: float) -> bool:
        """True when `value` is in the interval or one of the extra values; never NaN or an infinity (a command's
        float option parses them, the config's keys already refuse them)."""
        if any(value == v for v, _ in self.also):
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = "a number"
        extra = [f"{_num(v)} ({meaning})" if meaning else _num(v) for v, meaning in self.also]
        return " or ".join([*extra, text])

    def just_outside(self, kind: type) -> list[float]:
        """The nearest refused value past each finite end (ints step by 1, floats by one ulp), stepping over an
        extra value that lies next to an end (dp_shard's -1 below 1)."""
        def step(x: float, direction: float) -> float:
            return x + direction if kind is int else math.nextafter(x, direction * math.inf)

        out = []
        for end, is_open, direction in ((self.low, self.low_open, -1), (self.high, self.high_open, 1)):
            if end is None:
                continue
            value = kind(end) if is_open else step(kind(end), direction)
            while self.allows(value):
                value = step(value, direction)
            out.append(value)
        return out


def at_least(low: float, *also: tuple[float, str]) -> Range:
    """>= low (or one of `also`)."""
    return Range(low=low, also=also)


def above(low: float) -> Range:
    """> low."""
    return Range(low=low, low_open=True)


def between(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Range:
    """low..high, either end open."""
    return Range(low=low, high=high, low_open=low_open, high_open=high_open)


@dataclass(frozen=True)
class Knob:
    """One row of the table: what a value may be. `kind` is the type a command option is parsed as (a config key's
    type is its schema field's); `each` checks every item of a list value."""

    range: Range | None = None
    choices: tuple[str, ...] = ()
    why: str = ""
    kind: Any = None  # a command option's type; a family's [model] key's type (int, float, bool, list[int] ...)
    each: bool = False
    nonempty: bool = False  # a string that must hold something
    most: tuple[float, str] | None = None  # (a documented maximum, what it is): a larger number is refused
    what: str = "value"  # choices: what the value is ("decay type") in the refusal

    def check(self, name: str, value: Any) -> Any:
        """`value` (choices: in their canonical spelling), or a ConfigError naming `name`, the value and what is
        allowed."""
        if value is None:
            return value  # optional, not given
        shown = show(value)
        hint = f" ({self.why})" if self.why else ""
        if self.choices:
            if self.each and isinstance(value, list):
                return [self._choice(name, item, f"{name} item {show(item)}") for item in value]
            return self._choice(name, value, f"{name} = {shown}")
        if self.nonempty and not str(value).strip():
            raise option_error(name, f"{name} is empty{hint}")
        if self.range is not None:
            for item in (value if self.each else [value]):
                if isinstance(item, (int, float)) and not isinstance(item, bool) and not self.range.allows(item):
                    finite = "" if math.isfinite(item) else "a finite number "
                    raise option_error(name, f"{name} = {shown} must be {finite}{self.range}{hint}")
                if self.most is not None and isinstance(item, (int, float)) and item > self.most[0]:
                    raise option_error(name, f"{name} = {shown} is above {self.most[0]:,}, {self.most[1]}")
        return value

    def _choice(self, name: str, value: Any, shown: str) -> str:
        for choice in self.choices:
            if str(value).strip().lower() == choice.lower():
                return choice
        raise option_error(name, f"{shown} is not a known {self.what} (use {or_list(self.choices)})")


def option_error(name: str, message: str) -> ConfigError:
    """A ConfigError that remembers which key or option it is about (the loader names the file line that set it)."""
    error = ConfigError(message)
    error.key = name  # type: ignore[attr-defined]
    return error


def or_list(choices: tuple[str, ...] | list[str]) -> str:
    """'a, b or c'."""
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


# Rows of a family's own [model] keys (declared in its folder, models/<family>/args.py): `kind` is the key's type.
FLAVOR_VALUE = "leave it out to take the flavor's value"


def size_key(kind: type = int) -> Knob:
    """A positive size or number; unset = the flavor's."""
    return Knob(above(0), why=FLAVOR_VALUE, kind=kind)


def off_key(kind: type = float) -> Knob:
    """A number from 0, where 0 turns the feature off."""
    return Knob(at_least(0), why="0 = off", kind=kind)


def switch_key() -> Knob:
    """A true/false [model] key."""
    return Knob(kind=bool)

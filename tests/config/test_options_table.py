"""The table of every knob (titan_npu/config/options.py): every config key and every option of every command has a
row, and every row refuses a value just outside what it accepts (past its range, above its documented maximum),
before any work: one line on stderr naming the option, the value and the allowed values, exit code 2, nothing on
disk changed.

The commands run in this process through the dispatcher (titan_npu.cli.main), as `titan-npu <command>` runs them;
tests/reliability/test_bad_inputs.py runs a few of the same refusals as real processes.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import pytest
from tiny_run import snapshot

from titan_npu.cli import COMMANDS
from titan_npu.cli import main as cli_main
from titan_npu.commands.parsing import option_name
from titan_npu.config.coerce import field_types, key_types, section_types
from titan_npu.config.options import COMMAND_OPTIONS, CONFIG_KEYS, Knob, Range, model_key_rows

# What each command needs besides the option under test ({d}: an empty folder the command may not touch).
BASE_ARGV = {
    "train": [],
    "prepare-data": ["{d}/corpus.txt", "--output", "{d}/out"],
    "train-tokenizer": ["{d}/corpus.txt", "--output", "{d}/tok"],
    "export": ["--checkpoint", "{d}/ckpt", "--output", "{d}/w.pt"],
    "import": ["--input", "{d}/hf", "--output", "{d}/w.pt"],
    "init-weights": ["--output", "{d}/seed"],
    "plan": [],
    "doctor": [],
    "generate": ["--checkpoint", "{d}/ckpt"],
    "eval": ["--checkpoint", "{d}/ckpt", "--tasks", "titan_mc"],
    "report": ["{d}/logs"],
    "bench": [],
}


def _parser(command: str) -> argparse.ArgumentParser:
    return importlib.import_module(f"titan_npu.commands.{COMMANDS[command][0]}").build_parser()


def _kind(action: argparse.Action) -> type:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return bool
    return action.type or str


def _schema_type(name: str) -> type:
    """A key's type without its `| None`; a list's item type."""
    section, key = name.split(".", 1)
    hint = key_types(section)[key]
    while getattr(hint, "__args__", None):
        hint = next(a for a in hint.__args__ if a is not type(None))
    return hint


def _outside(knob: Knob, kind: type) -> list[str]:
    """Values (as typed on a command line) that `knob` refuses, each next to what it accepts."""
    if knob.choices:
        return ["not-a-choice"]
    if knob.nonempty:
        return [""]
    if knob.range is None:
        return []
    values = list(knob.range.just_outside(kind))
    if knob.most is not None:  # a documented maximum: the next value above it
        values.append(int(knob.most[0]) + 1 if kind is int else knob.most[0] * 2)
    return [f"[{v}]" if knob.each else repr(v) for v in values]


def _config_rows() -> list[tuple[str, Knob, str]]:
    """(key, row, the model.name it is given under): the shared rows, then each family's own [model] keys (one case
    per distinct row of a key: the families that declare the same row share it)."""
    rows = [(name, knob, "llama3") for name, knob in CONFIG_KEYS.items()]
    for name, per_family in model_key_rows().items():
        seen: list[Knob] = []
        for family, knob in per_family.items():
            if knob not in seen:
                seen.append(knob)
                rows.append((name, knob, family))
    return rows


def _config_cases() -> list[tuple[str, str, str]]:
    return [(name, value, family) for name, knob, family in _config_rows()
            for value in _outside(knob, int if _schema_type(name) is int else float)]


def _option_cases() -> list[tuple[str, str, str]]:
    return [(command, name, value) for command, rows in COMMAND_OPTIONS.items() for name, knob in rows.items()
            if not knob.choices  # argparse refuses an unknown choice itself (one line too: test below)
            for value in _outside(knob, knob.kind or str)]


# ---- the table is complete: a new key or option cannot skip it

def test_every_config_key_has_a_row_and_every_row_is_a_key():
    keys = {f"{section}.{key}" for section in section_types() for key in field_types(section)}
    assert sorted(keys - CONFIG_KEYS.keys()) == [], "config keys without a row in config/options.py CONFIG_KEYS"
    assert sorted(CONFIG_KEYS.keys() - keys) == [], "rows of CONFIG_KEYS that are no config key"


def test_every_command_has_rows_and_every_option_its_row_of_the_same_type_and_choices():
    assert set(COMMAND_OPTIONS) == set(COMMANDS) == set(BASE_ARGV)
    for command, rows in COMMAND_OPTIONS.items():
        actions = [a for a in _parser(command)._actions if not isinstance(a, argparse._HelpAction)]
        names = [option_name(a) for a in actions]
        assert sorted(set(names) - rows.keys()) == [], f"{command}: options without a row in COMMAND_OPTIONS"
        assert sorted(rows.keys() - set(names)) == [], f"{command}: rows for options it does not have"
        for action in actions:
            row = rows[option_name(action)]
            assert row.kind is _kind(action), f"{command} {option_name(action)}: the row says {row.kind}"
            assert tuple(action.choices or ()) == row.choices, f"{command} {option_name(action)}: choices differ"


def test_every_numeric_row_has_a_range_or_says_why_not():
    free = sorted({name for name, knob, _ in _config_rows()
                   if _schema_type(name) in (int, float) and knob.range is None})
    assert free == [], f"numeric config keys without a range: {free}"
    for command, rows in COMMAND_OPTIONS.items():
        free = sorted(name for name, row in rows.items() if row.kind in (int, float) and row.range is None)
        assert free == [], f"{command}: numeric options without a range: {free}"


@pytest.mark.parametrize(("rng", "kind", "text", "outside"), [
    (Range(low=1), int, ">= 1", [0]),
    (Range(low=0, low_open=True), float, "> 0", [0.0]),
    (Range(0, 1, low_open=True), float, "in (0, 1]", [0.0, 1.0000000000000002]),
    (Range(0, 1, high_open=True), float, "in [0, 1)", [-5e-324, 1.0]),
    (Range(low=1, also=((-1, "all remaining ranks"),)), int, "-1 (all remaining ranks) or >= 1", [0]),
    (Range(low=2, also=((0, "off"),)), float, "0 (off) or >= 2", [1.9999999999999998]),
    (Range(1, 65535, also=((0, "keep"),)), int, "0 (keep) or in [1, 65535]", [-1, 65536]),
])
def test_a_range_says_itself_as_a_person_writes_it_and_knows_its_neighbours(rng, kind, text, outside):
    assert str(rng) == text
    assert rng.just_outside(kind) == outside
    assert not any(rng.allows(v) for v in outside)


# ---- every row refuses the value next to its range, in one line, before anything is written

def _refused(argv: list[str], d: Path, capsys) -> str:
    before = snapshot(d)
    capsys.readouterr()
    rc = cli_main([a.replace("{d}", str(d)) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == "", out
    assert snapshot(d) == before, "a refused command changed the folder it was given"
    return err.strip()


@pytest.fixture
def quiet_dir(tmp_path, monkeypatch):
    """An empty folder that is also the working directory (default log/checkpoint dirs land there if anything
    is written), without a launcher's environment."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "case").mkdir()
    monkeypatch.chdir(tmp_path / "case")
    return tmp_path / "case"


def _says_its_bounds(knob: Knob, line: str) -> bool:
    """The refusal names the range, or (above it) the documented maximum and what it is."""
    above = knob.most is not None and f" is above {knob.most[0]:,}, {knob.most[1]}" in line
    return f" must be {knob.range}" in line or above


@pytest.mark.parametrize(("key", "value", "family"), _config_cases(),
                         ids=[f"{k}={v}" if k in CONFIG_KEYS else f"{f}:{k}={v}" for k, v, f in _config_cases()])
def test_a_config_key_just_outside_its_range_is_refused_in_one_line(key, value, family, quiet_dir, capsys):
    line = _refused(["train", f"--model.name={family}", f"--{key}={value}"], quiet_dir, capsys)
    knob = CONFIG_KEYS[key] if key in CONFIG_KEYS else model_key_rows()[key][family]
    assert line.startswith(f"ConfigError: command line: {key} "), line
    if knob.range is not None:
        assert _says_its_bounds(knob, line), line
    elif knob.choices:
        assert f"(use {', '.join(knob.choices[:-1])}" in line, line
    else:
        assert f"{key} is empty" in line, line


@pytest.mark.parametrize(("command", "option", "value"), _option_cases(),
                         ids=[f"{c} {o}={v}" for c, o, v in _option_cases()])
def test_a_command_option_just_outside_its_range_is_refused_in_one_line(command, option, value, quiet_dir, capsys):
    knob = COMMAND_OPTIONS[command][option]
    assert option.startswith("--")  # the positionals (paths) are free
    line = _refused([command, *BASE_ARGV[command], f"{option}={value}"], quiet_dir, capsys)
    assert line.startswith(f"ConfigError: {option} "), line
    assert _says_its_bounds(knob, line) if knob.range is not None else f"{option} is empty" in line, line


@pytest.mark.parametrize("argv", [
    ["generate", "--checkpoint", "{d}/ckpt", "--dtype", "fp8"],
    ["prepare-data", "{d}/c.txt", "--output", "{d}/out", "--workers", "two"],
    ["export", "--output", "{d}/w.pt"],
], ids=["unknown-choice", "wrong-type", "missing-option"])
def test_a_usage_error_is_one_line_naming_the_option(argv, quiet_dir, capsys):
    line = _refused(argv, quiet_dir, capsys)
    option = {"generate": "--dtype", "prepare-data": "--workers", "export": "--checkpoint"}[argv[0]]
    assert line.startswith(f"ConfigError: titan-npu {argv[0]}: ") and option in line, line
    assert line.endswith(f"(see titan-npu {argv[0]} --help)"), line


def test_the_config_keys_refused_here_are_refused_by_every_command_that_reads_a_config(quiet_dir, capsys):
    for command in ("plan", "doctor", "bench", "init-weights"):
        argv = [command, *BASE_ARGV[command], "--training.batch_size=0"]
        assert _refused(argv, quiet_dir, capsys) == (
            "ConfigError: command line: training.batch_size = 0 must be >= 1 (sequences per device per micro-step)")
    assert _refused(["train", "--dry-run", "--world-size", "2", "--parallel.tp_degree=0"], quiet_dir, capsys) == (
        "ConfigError: command line: parallel.tp_degree = 0 must be >= 1 (1 = this dimension is not split)")
    assert os.listdir(quiet_dir) == []

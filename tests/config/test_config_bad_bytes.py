"""Config files with bad bytes or structure are read or refused in one line through the command line: a byte-order
mark is accepted (as on the YAML side), a non-UTF-8 byte names its line, a duplicate TOML key or table is named, and
a YAML alias bomb under a valid key is refused before it expands (a subprocess shows it ends)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import refusal_line

from titan_npu.cli import main as cli_main
from titan_npu.config.loader import MAX_YAML_VALUES, read_config_file

REPO = Path(__file__).resolve().parents[2]
LLAMA = b'[model]\nname = "llama3"\nflavor = "debug"\n'




MUON_EXCLUDE = "model:\n  name: llama3\n  flavor: debug\noptimizer:\n  muon_exclude:\n"
LAYER_TYPES = "model:\n  name: llama3\n  flavor: debug\n  layer_types:\n"


def _bomb(levels: int = 9, head: str = MUON_EXCLUDE) -> str:
    """Billion laughs as the list under `head`'s last key: each level nine aliases of the one before."""
    text = head + "    - &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(1, levels + 1):
        text += f"    - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
    return text


def test_a_toml_file_with_a_byte_order_mark_is_read_like_one_without(tmp_path):
    plain, marked = tmp_path / "plain.toml", tmp_path / "marked.toml"
    plain.write_bytes(LLAMA)
    marked.write_bytes(b"\xef\xbb\xbf" + LLAMA)
    assert read_config_file(marked) == read_config_file(plain)


def test_plan_accepts_a_toml_config_with_a_byte_order_mark(tmp_path, capsys):
    path = tmp_path / "marked.toml"
    path.write_bytes(b"\xef\xbb\xbf" + LLAMA)
    assert cli_main(["plan", "--config", str(path), "--nodes", "1", "--devices-per-node", "1", "--top", "1"]) == 0
    assert "Error" not in capsys.readouterr().err


@pytest.mark.parametrize("text, said", [
    (LLAMA + b"dim = 64\ndim = 128\n", r"key dim in \[model\] is set twice \(the second time at line 5\); keep one"),
    (b"seed = 1\nseed = 2\n" + LLAMA, r"key seed is set twice \(the second time at line 2\)"),
    (LLAMA + b"[model]\ndim = 64\n", r"table \[model\] is declared twice \(the second time at line 4\); merge"),
    (LLAMA + b"dim = 64\n[model.dim]\nx = 1\n", r"table \[model.dim\] at line 5 redefines a key"),
], ids=["key twice", "top-level key twice", "table twice", "table over a value"])
def test_a_duplicate_toml_key_is_named_with_its_line(tmp_path, capsys, text, said):
    path = tmp_path / "dup.toml"
    path.write_bytes(text)
    line = refusal_line(capsys, ["plan", "--config", str(path)])
    assert line.startswith(f"ConfigError: {path}: invalid TOML: ")
    assert re.search(said, line), line


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_non_utf8_byte_in_a_config_names_its_line(tmp_path, capsys, suffix):
    path = tmp_path / f"bad{suffix}"
    body = LLAMA if suffix == ".toml" else b"model:\n  name: llama3\n  flavor: debug\n"
    path.write_bytes(body + (b'# caf\xe9\n' if suffix == ".toml" else b"# caf\xe9\n"))
    line = refusal_line(capsys, ["plan", "--config", str(path)])
    assert line == f"ConfigError: {path}:4: not UTF-8 text (byte 0xe9 at offset {len(body) + 5}); save the file as " \
                   "UTF-8"


@pytest.mark.parametrize("head", [MUON_EXCLUDE, LAYER_TYPES], ids=["optimizer.muon_exclude", "model.layer_types"])
def test_a_yaml_alias_bomb_under_a_valid_key_is_refused_before_it_expands(tmp_path, capsys, head):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(head=head))
    line = refusal_line(capsys, ["plan", "--config", str(path)])
    assert f"expand it past the {MAX_YAML_VALUES:,} values a config may hold" in line, line
    assert line.startswith(f"ConfigError: {path}: invalid YAML")


def test_a_yaml_alias_inside_its_own_anchor_is_refused(tmp_path, capsys):
    path = tmp_path / "loop.yaml"
    path.write_text("model: &m\n  name: llama3\n  again: *m\n")
    assert "an alias inside its own anchor" in refusal_line(capsys, ["plan", "--config", str(path)])


def test_yaml_aliases_of_an_ordinary_size_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("betas: &b [0.9, 0.95]\nmodel:\n  name: llama3\noptimizer:\n  betas: *b\n")
    assert read_config_file(path)["optimizer"]["betas"] == [0.9, 0.95]
    small = tmp_path / "small_bomb.yaml"
    small.write_text(_bomb(levels=3))  # 9**4 = 6,561 values: an unusual file, not a bomb
    assert len(read_config_file(small)["optimizer"]["muon_exclude"]) == 4


def test_train_refuses_a_yaml_alias_bomb_in_a_real_process_and_ends(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(levels=12))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "alias bomb" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.yaml"]


@pytest.mark.parametrize("suffix, body", [
    (".toml", '[model]\nname = "llama3"\n[optimizer]\nbetas = ' + "[" * 5000 + "]" * 5000 + "\n"),
    (".yaml", "model:\n  name: llama3\noptimizer:\n  betas: " + "[" * 5000 + "]" * 5000 + "\n"),
])
def test_values_nested_too_deeply_are_refused_in_one_line(tmp_path, capsys, suffix, body):
    path = tmp_path / f"deep{suffix}"
    path.write_text(body)
    line = refusal_line(capsys, ["plan", "--config", str(path)])
    assert line.startswith(f"ConfigError: {path}: values nested too deeply"), line


def test_a_very_long_value_is_shown_cut_in_its_one_line(capsys):
    value = "[" * 3000 + "]" * 3000
    line = refusal_line(capsys, ["plan", "--config", str(REPO / "configs" / "debug.toml"), "--optimizer.betas", value])
    assert "... (6,002 characters) is not a list of floats" in line and len(line) < 400, line

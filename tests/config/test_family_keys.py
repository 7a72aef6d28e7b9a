"""[model] is the family's own arguments: each family declares its keys with their ranges in its folder
(ModelSpec.model_keys), a key of another family is refused in one line naming the family and its keys (it used to be
accepted and silently ignored), the guides' dialects (d_model, YAML model:) keep working, and the options table's
model rows are generated from the families."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tiny_run import snapshot

from titan_npu.cli import main as cli_main
from titan_npu.config.coerce import field_types, key_types
from titan_npu.config.loader import load_config
from titan_npu.config.options import CONFIG_KEYS, Knob, model_key_rows
from titan_npu.config.schema import SHARED_MODEL_KEYS, ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.models.registry import SPECS, build_model_args

LLAMA_KEYS = "its keys: dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, ffn_dim"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- a key this family lacks: one line naming the family and its keys

def test_a_deepseek_key_in_a_llama_toml_is_refused_naming_the_line_the_family_and_its_keys(tmp_path):
    path = _write(tmp_path, "c.toml", '[model]\nname = "llama3"\ndim = 64\nq_lora_rank = 16\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    line = str(e.value)
    assert line.startswith(f"{path}:4: model.q_lora_rank is not a key of the llama3 family; {LLAMA_KEYS}"), line
    assert line.endswith("tie_embeddings (see docs/config.md)") and "\n" not in line, line


def test_a_deepseek_key_in_a_llama_yaml_model_section_is_refused_the_same_way(tmp_path):
    path = _write(tmp_path, "c.yaml", "model:\n  name: llama2_7b\n  kv_lora_rank: 32\ntraining:\n  max_steps: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}:3: model.kv_lora_rank is not a key of the llama2 family; {LLAMA_KEYS}")


def test_a_deepseek_key_on_the_command_line_is_refused_in_one_line_by_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    rc = cli_main(["train", "--config", str(Path(__file__).parents[2] / "configs/llama_7b.toml"),
                   "--model.n_shared_experts", "2"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("ConfigError: command line: model.n_shared_experts is not a key of the llama2 family; "
                          + LLAMA_KEYS), err
    assert snapshot(tmp_path) == before


def test_a_family_changed_on_the_command_line_refuses_the_files_keys_of_the_old_family(tmp_path):
    path = Path(__file__).parents[2] / "configs/debug_deepseek.toml"
    with pytest.raises(ConfigError) as e:
        load_config(path, ["--model.name", "qwen3"])
    assert f"{path}:" in str(e.value) and "is not a key of the qwen3 family" in str(e.value)


def test_a_config_built_in_code_is_held_to_its_family_too():
    with pytest.raises(ConfigError, match="model.sliding_window is not a key of the qwen3_moe family"):
        load_config(None, ["--model.name", "qwen3_moe", "--model.sliding_window", "64"])
    from titan_npu.config.loader import config_from_dict

    with pytest.raises(ConfigError, match="model.linear_n_k_heads is not a key of the gpt_oss family"):
        config_from_dict({"model": {"name": "gpt_oss", "linear_n_k_heads": 4}})


def test_a_key_of_no_family_is_still_an_unknown_key_with_the_closest_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'model.dimm' \(did you mean 'model.dim'\?\)"):
        load_config(None, ["--model.dimm", "64"])


# ---- each family's own keys are accepted, typed, range-checked and read by its args

def _valid(knob: Knob):
    if knob.choices:
        return [knob.choices[0]] if knob.each else knob.choices[0]
    if knob.kind is bool:
        return True
    if knob.range is None:
        return 1
    value = knob.range.high if knob.range.high is not None else knob.range.low + 1
    value = value if knob.kind is float else int(value)
    return [value] if knob.each else value


@pytest.mark.parametrize("family", list(SPECS))
def test_every_key_a_family_declares_is_accepted_under_that_family(family):
    keys = SPECS[family].model_keys
    overrides = [f"--model.name={family}"]
    for key, knob in keys.items():
        value = _valid(knob)
        overrides.append(f"--model.{key}={','.join(map(str, value)) if isinstance(value, list) else value}")
    cfg = load_config(None, overrides)
    assert set(cfg.model.keys) == set(keys)
    for key, knob in keys.items():
        assert cfg.model.keys[key] == _valid(knob), key


@pytest.mark.parametrize("family", list(SPECS))
def test_a_familys_keys_set_to_its_flavors_values_give_the_same_args(family):
    """Every declared key that is a field of the family's args is read by build_args (same values, same args)."""
    preset = build_model_args(ModelConfig(name=family, flavor="debug"))
    fields = {f.name for f in dataclasses.fields(preset)}
    own = {k: getattr(preset, k) for k in SPECS[family].model_keys if k in fields and getattr(preset, k) is not None}
    assert own, family
    assert build_model_args(load_config(None, [f"--model.name={family}"]).model) == preset
    model = ModelConfig(name=family, flavor="debug", **own)
    assert build_model_args(model) == preset


def test_unset_keys_read_as_none_and_setting_one_on_a_loaded_config_works():
    cfg = load_config(None, ["--model.name", "deepseek_v3"])
    assert cfg.model.q_lora_rank is None and cfg.model.keys == {}
    cfg.model.dim = 96
    assert cfg.model.keys == {"dim": 96}
    with pytest.raises(AttributeError):
        _ = cfg.model.not_a_key_of_any_family


def test_a_family_key_out_of_its_range_names_the_range_that_family_declares():
    with pytest.raises(ConfigError, match=r"model.layer_types item 'linear_attention' is not a known attention layer "
                                          r"type \(use sliding_attention or full_attention\)"):
        load_config(None, ["--model.name", "gpt_oss", "--model.layer_types", "linear_attention"])


# ---- the guides' dialects

def test_d_model_in_the_toml_guide_is_dim():
    cfg = load_config(Path(__file__).parents[2] / "configs/llama_7b.toml")
    assert cfg.model.name == "llama2" and cfg.model.flavor == "7B" and cfg.model.dim == 4096
    assert "d_model" not in cfg.model.keys


def test_the_yaml_model_section_with_d_model_loads_the_family_keys(tmp_path):
    path = _write(tmp_path, "c.yaml", "model:\n  name: qwen3_moe\n  d_model: 64\n  n_experts: 4\n  top_k: 2\n"
                                      "  use_flash_attention: false\n")
    cfg = load_config(path)
    assert cfg.model.keys == {"dim": 64, "n_experts": 4, "top_k": 2} and cfg.model.use_flash_attention is False
    assert load_config(Path(__file__).parents[2] / "configs/llama3_7b.yaml").model.dim == 4096


def test_d_model_and_dim_set_differently_are_still_refused(tmp_path):
    path = _write(tmp_path, "c.toml", '[model]\nname = "llama3"\nd_model = 64\ndim = 128\n')
    with pytest.raises(ConfigError, match="set the same setting"):
        load_config(path)


# ---- the options table's model rows come from the families

def test_the_generated_model_rows_cover_every_family_key_with_its_range_and_one_type():
    rows = model_key_rows()
    for family, spec in SPECS.items():
        for key, knob in spec.model_keys.items():
            assert rows[f"model.{key}"][family] is knob
    for name, per_family in rows.items():
        kinds = {knob.kind for knob in per_family.values()}
        assert len(kinds) == 1 and None not in kinds, f"{name}: one type across families, got {kinds}"
        kind = next(iter(kinds))
        assert key_types("model")[name.split(".", 1)[1]] == kind | None
        if kind in (int, float) or kind == list[int]:
            assert all(knob.range is not None for knob in per_family.values()), f"{name} has no range"
    assert set(rows).isdisjoint(CONFIG_KEYS), "a family key that is a shared one too"


def test_the_schema_keeps_only_the_shared_model_keys():
    assert tuple(field_types("model")) == SHARED_MODEL_KEYS
    assert {f"model.{k}" for k in SHARED_MODEL_KEYS} == {k for k in CONFIG_KEYS if k.startswith("model.")}


def test_qwen3_next_reads_its_variant_key_which_every_family_used_to_ignore():
    cfg = load_config(None, ["--model.name", "qwen3_next", "--model.variant", "qwen3_5"])
    assert build_model_args(cfg.model).variant == "qwen3_5"
    assert build_model_args(load_config(None, ["--model.name", "qwen3_next"]).model).variant == "qwen3_next"
    with pytest.raises(ConfigError, match="model.variant is not a key of the llama3 family"):
        load_config(None, ["--model.variant", "qwen3_5"])

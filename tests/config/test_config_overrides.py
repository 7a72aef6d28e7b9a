"""Command-line overrides: every spelling of a key and a value, applied on top of the file."""

from __future__ import annotations

import pytest

from titan_npu.config.loader import load_config, parse_overrides
from titan_npu.errors import ConfigError


def test_space_and_equals_forms_set_values_with_schema_types():
    cfg = load_config(None, ["--model.dim", "64", "--training.seq_len=64", "--optimizer.lr", "3e-4"])
    assert cfg.model.dim == 64 and isinstance(cfg.model.dim, int)
    assert cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)


def test_directory_flags_map_to_their_sections():
    cfg = load_config(None, ["--data_dir", "/x", "--checkpoint_dir", "/c", "--log_dir", "/l"])
    assert (cfg.data.path, cfg.checkpoint.dir, cfg.metrics.log_dir) == ("/x", "/c", "/l")


def test_train_help_names_every_short_flag_and_the_key_it_sets():
    """The README launches with --data_dir / --checkpoint_dir / --log_dir: `train.py --help` must say they exist."""
    import re

    from titan_npu.commands.train import build_parser
    from titan_npu.config.aliases import TOP_LEVEL_ALIASES

    text = " ".join(build_parser().format_help().split())
    for alias, (section, key) in TOP_LEVEL_ALIASES.items():
        assert re.search(rf"--{alias}\b", text) and f"--{section}.{key}" in text, (alias, text)


def test_dashed_flag_names_are_accepted():
    cfg = load_config(None, ["--checkpoint-dir", "/c", "--lr-scheduler.warmup-steps", "7"])
    assert (cfg.checkpoint.dir, cfg.lr_scheduler.warmup_steps) == ("/c", 7)


def test_aliases_are_accepted_in_overrides():
    cfg = load_config(
        None,
        ["--training.learning_rate", "1e-4", "--distributed.tp_size", "2", "--training.steps", "9",
         "--training.checkpoint.max_keep", "5", "--dtype", "float16", "--model.d_model", "128"],
    )
    assert cfg.optimizer.lr == 1e-4
    assert cfg.parallel.tp_degree == 2
    assert cfg.training.max_steps == 9
    assert cfg.checkpoint.keep_last_n == 5
    assert cfg.training.dtype == "fp16"
    assert cfg.model.dim == 128


def test_bool_flag_alone_is_true():
    assert load_config(None, ["--compile.enable"]).compile.enable is True
    # followed by another flag, it is still a flag on its own
    cfg = load_config(None, ["--compile.enable", "--model.dim", "64"])
    assert (cfg.compile.enable, cfg.model.dim) == (True, 64)


@pytest.mark.parametrize(
    ("word", "value"),
    [("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False), ("False", False)],
)
def test_bool_words(word, value):
    assert load_config(None, ["--compile.enable", word]).compile.enable is value
    assert load_config(None, [f"--metrics.tensorboard={word}"]).metrics.tensorboard is value


@pytest.mark.parametrize("text", ["0.9,0.95", "[0.9, 0.95]", "[0.9,0.95]", " 0.9 , 0.95 "])
def test_list_values(text):
    assert load_config(None, ["--optimizer.betas", text]).optimizer.betas == [0.9, 0.95]


def test_int_list_and_empty_list():
    assert load_config(None, ["--profiling.ranks", "0,3"]).profiling.ranks == [0, 3]
    assert load_config(None, ["--profiling.ranks=[]"]).profiling.ranks == []


def test_optional_int_accepts_a_number_and_null():
    assert load_config(None, ["--model.n_kv_heads", "4"]).model.n_kv_heads == 4
    assert load_config(None, ["--model.n_kv_heads", "none"]).model.n_kv_heads is None


def test_negative_number_is_a_value_not_a_flag():
    assert load_config(None, ["--parallel.dp_shard", "-1"]).parallel.dp_shard == -1


def test_int_accepts_exponent_notation_of_a_whole_number():
    assert load_config(None, ["--training.max_steps", "1e5"]).training.max_steps == 100000


def test_empty_string_value_with_equals():
    assert load_config(None, ["--data.path="]).data.path == ""


def test_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "llama3_8b"\ndim = 4096\n[optimizer]\nlr = 3e-4\n')
    cfg = load_config(path, ["--model.dim", "64", "--training.learning_rate", "1e-3"])
    assert (cfg.model.dim, cfg.optimizer.lr) == (64, 1e-3)
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "8B")  # untouched keys keep the file's values


def test_sized_model_name_override_also_sets_the_flavor(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "llama3_8b"\n')
    cfg = load_config(path, ["--model.name", "llama3_70b"])
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "70B")


def test_later_override_of_the_same_key_wins():
    assert load_config(None, ["--model.dim", "64", "--model.dim", "128"]).model.dim == 128


def test_parse_overrides_keeps_values_as_strings_and_nests_keys():
    raw = parse_overrides(["--model.dim", "64", "--a.b.c=d", "--flag"])
    assert raw["model"] == {"dim": "64"}
    assert raw["a"] == {"b": {"c": "d"}}
    assert "flag" in raw


def test_non_bool_key_without_a_value_is_an_error():
    with pytest.raises(ConfigError, match=r"^command line: --model.dim needs a value"):
        load_config(None, ["--model.dim"])


def test_positional_token_is_an_error():
    with pytest.raises(ConfigError, match=r"command line: unexpected argument 'oops'"):
        load_config(None, ["oops"])


def test_malformed_key_is_an_error():
    with pytest.raises(ConfigError, match=r"malformed override '--model..dim=3'"):
        load_config(None, ["--model..dim=3"])


def test_unknown_override_key_names_the_command_line_and_the_closest_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.n_layer", "4"])
    assert str(e.value) == "command line: unknown key 'model.n_layer' (did you mean 'model.n_layers'?)"


def test_bad_override_value_names_the_command_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.dim", "abc"])
    assert str(e.value) == "command line: model.dim = 'abc' is not an int"


def test_invalid_override_value_names_the_command_line_and_the_alias_used(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--training.learning_rate", "-1"])
    message = str(e.value)
    assert message.startswith("command line: optimizer.lr = -1.0 must be > 0")
    assert "(set as 'training.learning_rate')" in message


def test_alias_and_canonical_overrides_that_disagree_are_an_error():
    with pytest.raises(ConfigError, match=r"'training.learning_rate' = '1e-4' and 'optimizer.lr' = '2e-4'"):
        load_config(None, ["--training.learning_rate", "1e-4", "--optimizer.lr", "2e-4"])


def test_loading_is_pure(tmp_path, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text("[model]\ndim = 64\n")
    tokens = ["--model.n_layers", "2"]
    monkeypatch.chdir(tmp_path)
    first = load_config(path, tokens)
    first.model.dim = 999  # mutating one result must not leak into the next load
    second = load_config(path, tokens)
    assert (second.model.dim, second.model.n_layers) == (64, 2)
    assert tokens == ["--model.n_layers", "2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]

"""save_config -> load_config gives back an equal config, in TOML and YAML; writes are atomic."""

from __future__ import annotations

import json
import os

import pytest

from titan_npu.config import JobConfig
from titan_npu.config.loader import config_to_dict, load_config, save_config
from titan_npu.errors import ConfigError


def non_default_config() -> JobConfig:
    cfg = load_config(
        None,
        ["--model.name", "llama3_8b", "--model.dim", "4096", "--model.ffn_dim_multiplier", "1.3",
         "--model.rope_scaling_factor", "8.0", "--optimizer.betas", "0.8,0.999", "--optimizer.eps", "1e-12",
         "--training.dtype", "bfloat16", "--parallel.pp_schedule", "gpipe", "--profiling.ranks", "0,5",
         "--lr_scheduler.min_lr_ratio", "0", "--compile.enable", "--checkpoint.resume", "1200"],
    )
    # Strings that need escaping in TOML and quoting in YAML.
    cfg.data.path = 'C:\\data\\"quoted" shards\tnew\nline é 中 \x7f'
    cfg.checkpoint.dir = "yes"  # a YAML 1.1 boolean word, must stay a string
    cfg.metrics.log_dir = "1e-3"  # looks like a number, must stay a string
    return cfg


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".yml"])
def test_save_then_load_gives_an_equal_config(tmp_path, suffix):
    cfg = non_default_config()
    path = tmp_path / f"saved{suffix}"
    save_config(cfg, path)
    assert load_config(path) == cfg


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_defaults_round_trip(tmp_path, suffix):
    path = tmp_path / f"d{suffix}"
    save_config(JobConfig(), path)
    assert load_config(path) == load_config(None)


def test_every_config_in_configs_round_trips(tmp_path, config_files):
    for source in config_files:
        cfg = load_config(source)
        for suffix in (".toml", ".yaml"):
            path = tmp_path / f"{source.stem}{suffix}"
            save_config(cfg, path)
            assert load_config(path) == cfg, f"{source} -> {path}"


def test_toml_output_is_canonical_and_omits_unset_optionals(tmp_path):
    path = tmp_path / "c.toml"
    save_config(load_config(None, ["--model.dim", "64"]), path)
    text = path.read_text()
    assert "[model]\nname = \"llama3\"\nflavor = \"debug\"\ndim = 64\n" in text
    assert "n_layers" not in text  # None: taken from the flavor
    assert "[parallel]" in text and "[distributed]" not in text


def test_yaml_is_written_for_any_other_suffix(tmp_path):
    path = tmp_path / "c.yaml"
    save_config(JobConfig(), path)
    assert path.read_text().startswith("model:\n  name: llama3\n")


def test_save_creates_missing_parent_directories(tmp_path):
    path = tmp_path / "a" / "b" / "c.toml"
    save_config(JobConfig(), path)
    assert load_config(path) == JobConfig()


def test_failed_save_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "c.toml"
    save_config(JobConfig(), path)
    before = path.read_bytes()
    cfg = JobConfig()
    cfg.data.path = {1, 2}  # type: ignore[assignment]  # not writable
    with pytest.raises(ConfigError, match=r"data.path = \{1, 2\} cannot be written to TOML"):
        save_config(cfg, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.toml"]


def test_failed_yaml_save_leaves_no_file(tmp_path):
    cfg = JobConfig()
    cfg.data.path = object()  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"cannot write .*c.yaml as YAML"):
        save_config(cfg, tmp_path / "c.yaml")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_saved_file_gets_the_umask_mode_like_any_written_file(tmp_path, umask):
    path = tmp_path / "c.toml"
    old = os.umask(umask)
    try:
        save_config(JobConfig(), path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_saving_over_a_config_keeps_its_mode(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("")
    path.chmod(0o600)
    save_config(JobConfig(), path)
    assert path.stat().st_mode & 0o777 == 0o600


def test_unwritable_destination_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"cannot write .*c.toml: .*\(choose a writable path\)"):
        save_config(JobConfig(), blocker / "c.toml")


def test_config_to_dict_is_plain_nested_data_under_canonical_names():
    data = config_to_dict(load_config(None, ["--distributed.tp_size", "2"]))
    assert json.loads(json.dumps(data)) == data
    assert data["parallel"]["tp_degree"] == 2
    assert list(data) == [
        "model", "training", "optimizer", "lr_scheduler", "parallel", "activation_checkpoint", "compile", "float8",
        "checkpoint", "data", "metrics", "validation", "eval", "profiling", "comm", "reliability", "fault_tolerance",
        "lora",
    ]


def test_config_to_dict_copies_lists():
    cfg = JobConfig()
    data = config_to_dict(cfg)
    data["optimizer"]["betas"].append(0.5)
    assert cfg.optimizer.betas == [0.9, 0.95]

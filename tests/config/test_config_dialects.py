"""The Ascend guides' YAML and TOML dialects load unchanged into canonical values."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config.loader import load_config
from titan_npu.errors import ConfigError
from titan_npu.models.registry import parse_model_name

YAML_GUIDE = """\
model:
  name: llama3_7b
  dim: 4096
  n_layers: 32
  n_heads: 32
  vocab_size: 32000
  max_seq_len: 4096
  use_flash_attention: true
training:
  batch_size: 4
  seq_len: 4096
  gradient_accumulation_steps: 8
  learning_rate: 3.0e-4
  weight_decay: 0.1
  max_steps: 100000
  checkpoint:
    async_save: true
    save_interval: 1000
    max_keep: 3
parallel:
  dp_degree: 4
  tp_degree: 1
dtype: bf16
"""

TOML_GUIDE = """\
[model]
name = "llama"
vocab_size = 32000
d_model = 4096
n_heads = 32
n_layers = 32
[optimizer]
name = "AdamW"
lr = 3e-4
betas = [0.9, 0.95]
weight_decay = 0.1
[distributed]
backend = "hccl"
fsdp = true
tp_size = 1
pp_size = 1
[checkpoint]
save_interval = 1000
keep_last_n = 3
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_guide_loads_to_canonical_values(tmp_path):
    cfg = load_config(write(tmp_path, "guide.yaml", YAML_GUIDE))
    m = cfg.model
    assert (m.name, m.flavor) == ("llama3", "7B")
    assert (m.dim, m.n_layers, m.n_heads, m.vocab_size, m.max_seq_len) == (4096, 32, 32, 32000, 4096)
    assert m.use_flash_attention is True
    t = cfg.training
    assert (t.batch_size, t.seq_len, t.gradient_accumulation_steps, t.max_steps) == (4, 4096, 8, 100000)
    assert t.dtype == "bf16"
    assert cfg.optimizer.lr == 3e-4
    assert cfg.optimizer.weight_decay == 0.1
    c = cfg.checkpoint
    assert (c.async_save, c.save_interval, c.keep_last_n) == (True, 1000, 3)
    assert (cfg.parallel.dp_shard, cfg.parallel.tp_degree) == (4, 1)


def test_toml_guide_loads_to_canonical_values(tmp_path):
    cfg = load_config(write(tmp_path, "guide.toml", TOML_GUIDE))
    m = cfg.model
    # Plain "llama" is Llama 2; d_model 4096 with 32 layers is the published 7B size.
    assert (m.name, m.flavor) == ("llama2", "7B")
    assert (m.dim, m.n_heads, m.n_layers, m.vocab_size) == (4096, 32, 32, 32000)
    o = cfg.optimizer
    assert (o.name, o.lr, o.betas, o.weight_decay) == ("AdamW", 3e-4, [0.9, 0.95], 0.1)
    p = cfg.parallel
    assert (p.backend, p.fsdp, p.tp_degree, p.pp_degree, p.dp_shard) == ("hccl", True, 1, 1, -1)
    assert (cfg.checkpoint.save_interval, cfg.checkpoint.keep_last_n) == (1000, 3)


def test_guide_and_canonical_spellings_give_the_same_config(tmp_path):
    canonical = """\
model:
  name: llama3
  flavor: 7B
  dim: 4096
  n_layers: 32
  n_heads: 32
  vocab_size: 32000
  max_seq_len: 4096
training:
  batch_size: 4
  seq_len: 4096
  gradient_accumulation_steps: 8
  max_steps: 100000
  dtype: bf16
optimizer:
  lr: 3.0e-4
  weight_decay: 0.1
checkpoint:
  async_save: true
  save_interval: 1000
  keep_last_n: 3
parallel:
  dp_shard: 4
  tp_degree: 1
"""
    assert load_config(write(tmp_path, "guide.yaml", YAML_GUIDE)) == load_config(write(tmp_path, "c.yaml", canonical))


def test_other_guide_spellings_map_to_canonical_keys(tmp_path):
    text = """\
[training]
steps = 500
local_batch_size = 2
[metrics]
log_freq = 5
[checkpoint]
interval = 50
folder = "ckpt"
max_keep = 4
[distributed]
dp_degree = 2
"""
    cfg = load_config(write(tmp_path, "x.toml", text))
    assert (cfg.training.max_steps, cfg.training.batch_size) == (500, 2)
    assert cfg.metrics.log_interval == 5
    assert (cfg.checkpoint.save_interval, cfg.checkpoint.dir, cfg.checkpoint.keep_last_n) == (50, "ckpt", 4)
    assert cfg.parallel.dp_shard == 2


@pytest.mark.parametrize(
    ("name", "family", "flavor"),
    [
        ("llama", "llama2", "debug"),
        ("llama2", "llama2", "debug"),
        ("llama3", "llama3", "debug"),
        ("llama_7b", "llama2", "7B"),
        ("llama3_7b", "llama3", "7B"),
        ("llama2_13b", "llama2", "13B"),
        ("llama3_70b", "llama3", "70B"),
        ("Llama-3-8B", "llama3", "8B"),
    ],
)
def test_model_name_sets_family_and_flavor(tmp_path, name, family, flavor):
    cfg = load_config(write(tmp_path, "m.toml", f'[model]\nname = "{name}"\n'))
    assert (cfg.model.name, cfg.model.flavor) == (family, flavor)


def test_explicit_flavor_wins_over_the_size_in_the_name(tmp_path):
    cfg = load_config(write(tmp_path, "m.toml", '[model]\nname = "llama3_70b"\nflavor = "8b"\n'))
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "8B")


@pytest.mark.parametrize(
    ("given", "normalised"), [("7b", "7B"), ("70B", "70B"), ("Debug", "debug"), ("DEBUG", "debug")]
)
def test_flavor_is_matched_case_insensitively(tmp_path, given, normalised):
    cfg = load_config(write(tmp_path, "m.toml", f'[model]\nflavor = "{given}"\n'))
    assert cfg.model.flavor == normalised


def test_plain_family_with_unpublished_dims_keeps_the_default_flavor(tmp_path):
    cfg = load_config(write(tmp_path, "m.toml", '[model]\nname = "llama3"\ndim = 512\nn_layers = 4\n'))
    assert (cfg.model.flavor, cfg.model.dim) == ("debug", 512)


def test_split_model_name_rejects_other_models():
    assert parse_model_name("gpt2") == (None, None)
    assert parse_model_name("llama4") == (None, None)


def test_alias_and_canonical_with_the_same_value_are_accepted(tmp_path):
    text = "training:\n  learning_rate: 3.0e-4\noptimizer:\n  lr: '3e-4'\n"
    assert load_config(write(tmp_path, "x.yaml", text)).optimizer.lr == 3e-4


def test_alias_and_canonical_with_different_values_are_an_error_naming_both(tmp_path):
    text = "training:\n  learning_rate: 1.0e-3\noptimizer:\n  lr: 3.0e-4\n"
    path = write(tmp_path, "x.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert str(path) in message
    assert "'training.learning_rate' = 0.001" in message and "'optimizer.lr' = 0.0003" in message


def test_top_level_dtype_conflicting_with_training_dtype_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'training.dtype' = 'fp32' and 'dtype' = 'bf16'"):
        load_config(write(tmp_path, "x.yaml", "training:\n  dtype: fp32\ndtype: bf16\n"))


def test_training_checkpoint_conflicting_with_checkpoint_section_is_an_error(tmp_path):
    text = "checkpoint:\n  keep_last_n: 2\ntraining:\n  checkpoint:\n    max_keep: 5\n"
    with pytest.raises(ConfigError, match=r"'checkpoint.keep_last_n' = 2 and 'training.checkpoint.max_keep' = 5"):
        load_config(write(tmp_path, "x.yaml", text))


def test_dtype_long_names_are_normalised(tmp_path):
    cfg = load_config(write(tmp_path, "x.yaml", "dtype: bfloat16\ncheckpoint:\n  export_dtype: float32\n"))
    assert (cfg.training.dtype, cfg.checkpoint.export_dtype) == ("bf16", "fp32")


def test_choice_values_are_case_insensitive_and_normalised(tmp_path):
    text = """\
[parallel]
pp_schedule = "interleaved1f1b"
backend = "HCCL"
[optimizer]
name = "adamw"
[lr_scheduler]
decay_type = "Cosine"
[activation_checkpoint]
mode = "Selective"
[checkpoint]
resume = "NEVER"
"""
    cfg = load_config(write(tmp_path, "x.toml", text))
    assert cfg.parallel.pp_schedule == "Interleaved1F1B"
    assert cfg.parallel.backend == "hccl"
    assert cfg.optimizer.name == "AdamW"
    assert cfg.lr_scheduler.decay_type == "cosine"
    assert cfg.activation_checkpoint.mode == "selective"
    assert cfg.checkpoint.resume == "never"

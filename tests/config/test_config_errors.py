"""Every user mistake is one ConfigError line naming the file, the key, the value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_npu.config import JobConfig
from titan_npu.config.loader import load_config
from titan_npu.config.validate import validate
from titan_npu.errors import ConfigError


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(path: Path | str | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_unknown_key_names_file_key_and_closest_key(tmp_path):
    path = write(tmp_path, "x.toml", "[model]\nn_layer = 4\n")
    assert load_error(path) == f"{path}: unknown key 'model.n_layer' (did you mean 'model.n_layers'?)"


def test_unknown_key_in_the_wrong_section_points_to_the_right_one(tmp_path):
    path = write(tmp_path, "x.toml", "[training]\nlr = 0.1\n")
    assert "unknown key 'training.lr' (did you mean 'optimizer.lr'?)" in load_error(path)


def test_unknown_key_shared_by_several_sections_lists_them(tmp_path):
    path = write(tmp_path, "x.toml", "[metrics]\nenable = true\n")
    message = load_error(path)
    assert "unknown key 'metrics.enable' ('enable' is a key of the sections compile, float8, checkpoint" in message


def test_unknown_key_under_an_aliased_section_keeps_the_user_spelling(tmp_path):
    path = write(tmp_path, "x.toml", "[distributed]\ntp_sise = 2\n")
    assert "unknown key 'distributed.tp_sise' (did you mean 'distributed.tp_size'?)" in load_error(path)


def test_unknown_section_names_the_closest_section(tmp_path):
    path = write(tmp_path, "x.yaml", "modle:\n  dim: 4\n")
    assert load_error(path) == f"{path}: unknown section 'modle' (did you mean 'model'?)"


def test_unknown_top_level_key_names_the_section_key(tmp_path):
    path = write(tmp_path, "x.yaml", "lr: 0.1\n")
    assert load_error(path) == f"{path}: unknown key 'lr' (did you mean 'optimizer.lr'?)"


def test_unknown_key_without_a_close_match_points_to_the_docs(tmp_path):
    path = write(tmp_path, "x.toml", "[model]\nzzzzzz = 1\n")
    assert "unknown key 'model.zzzzzz'" in load_error(path)


def test_section_given_a_value_is_an_error(tmp_path):
    path = write(tmp_path, "x.yaml", "model: 7\n")
    assert "'model' is a section and needs keys under it" in load_error(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[model]\ndim = 'abc'\n", "model.dim = 'abc' is not an int"),
        ("[model]\ndim = 2.5\n", "model.dim = 2.5 is not an int"),
        ("[training]\nbatch_size = true\n", "training.batch_size = true is not an int"),
        ("[optimizer]\nlr = 'abc'\n", "optimizer.lr = 'abc' is not a float"),
        ("[compile]\nenable = 'maybe'\n", "compile.enable = 'maybe' is not a bool (use true/false, 1/0 or yes/no)"),
        ("[optimizer]\nbetas = [0.9, 'x']\n", "optimizer.betas = [0.9, 'x'] is not a list of floats"),
        ("[optimizer]\nbetas = 0.9\n", "optimizer.betas = 0.9 is not a list of floats"),
        ("[data]\npath = true\n", "data.path = true is not a str"),
        ("[model]\nn_kv_heads = 'four'\n", "model.n_kv_heads = 'four' is not an int"),
    ],
)
def test_wrong_type_names_file_key_value_and_type(tmp_path, text, expected):
    path = write(tmp_path, "x.toml", text)
    assert load_error(path).startswith(f"{path}:2: {expected}")


def test_wrong_type_under_an_alias_names_the_alias(tmp_path):
    path = write(tmp_path, "x.yaml", "training:\n  learning_rate: fast\n")
    assert load_error(path) == f"{path}:2: training.learning_rate = 'fast' is not a float"


def test_int_float_and_string_numbers_are_coerced(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  dim: '64'\noptimizer:\n  lr: 1\n  eps: 1e-8\n")
    cfg = load_config(path)
    assert (cfg.model.dim, cfg.optimizer.lr, cfg.optimizer.eps) == (64, 1.0, 1e-8)
    assert isinstance(cfg.optimizer.lr, float)


def test_missing_file(tmp_path):
    assert load_error("nope.toml") == "config file 'nope.toml' not found (check the path given to --config)"


def test_directory_instead_of_a_file(tmp_path):
    (tmp_path / "d.toml").mkdir()
    assert "is a directory" in load_error(tmp_path / "d.toml")


@pytest.mark.parametrize("name", ["x.json", "x.ini", "x"])
def test_bad_extension_names_it_and_the_supported_ones(tmp_path, name):
    message = load_error(write(tmp_path, name, "{}"))
    assert "unsupported extension" in message and ".toml, .yaml or .yml" in message
    assert (f"'{Path(name).suffix}'" if Path(name).suffix else "'(none)'") in message


def test_invalid_toml_names_file_line_and_column(tmp_path):
    path = write(tmp_path, "x.toml", "[model]\ndim = 4\nn_layers 5\n")
    message = load_error(path)
    assert message.startswith(f"{path}: invalid TOML:")
    assert "line 3" in message and "column" in message


def test_duplicate_toml_key_is_a_parse_error(tmp_path):
    assert "invalid TOML" in load_error(write(tmp_path, "x.toml", "[model]\ndim = 4\ndim = 5\n"))


def test_invalid_yaml_names_file_line_and_column(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  dim: 4\n n_layers: [1, 2\n")
    message = load_error(path)
    assert message.startswith(f"{path}: invalid YAML at line ")
    assert "column" in message


def test_duplicate_yaml_key_is_refused_with_its_line(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  dim: 4\n  dim: 5\n")
    assert load_error(path) == f"{path}: invalid YAML at line 3, column 3: key 'dim' is given twice (keep one)"


def test_yaml_python_tags_are_refused(tmp_path):
    path = write(tmp_path, "x.yaml", "model: !!python/object/apply:os.system ['true']\n")
    assert "invalid YAML" in load_error(path)


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    assert "top level must be a mapping" in load_error(write(tmp_path, "x.yaml", "- 1\n- 2\n"))


def test_an_empty_section_beside_a_key_is_harmless(tmp_path):
    text = "compile:\n#  enable: true\ntraining:\n  seed: 42\n"
    assert load_config(write(tmp_path, "x.yaml", text)) == load_config(None)


@pytest.mark.parametrize(("name", "text"), [
    ("x.yaml", ""),
    ("x.yaml", "# every line commented out\n#training:\n#  max_steps: 10\n"),
    ("x.yaml", "compile:\n#  enable: true\n"),
    ("x.toml", "\n\n"),
    ("x.toml", "# [training]\n# max_steps = 10\n"),
    ("x.toml", "[training]\n[optimizer]\n"),
])
def test_a_config_file_that_sets_nothing_is_refused_rather_than_run_on_defaults(tmp_path, name, text):
    message = load_error(write(tmp_path, name, text))
    assert f"{name}' sets nothing (it is empty or holds only comments and section headers)" in message
    assert "or leave out --config to run on the defaults" in message


def test_non_utf8_file_is_refused(tmp_path):
    path = tmp_path / "x.toml"
    path.write_bytes(b"[model]\nname = \"\xff\"\n")
    assert "not UTF-8" in load_error(path)


def test_unknown_model_name(tmp_path):
    message = load_error(write(tmp_path, "x.toml", '[model]\nname = "gpt2"\n'))
    assert "model.name = 'gpt2' is not a known model" in message and "llama3_8b" in message


# Section-local validation: (override tokens, the start of the message after "command line: ").
INVALID = [
    (["--optimizer.lr", "0"], "optimizer.lr = 0.0 must be > 0"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay = -0.1 must be >= 0"),
    (["--optimizer.betas", "0.9,1.0"], "optimizer.betas = [0.9, 1.0] must be in [0, 1) (two values"),
    (["--optimizer.betas", "-0.1,0.9"], "optimizer.betas = [-0.1, 0.9] must be in [0, 1) (two values"),
    (["--optimizer.betas", "0.9"], "optimizer.betas = [0.9] must be two values in [0, 1)"),
    (["--optimizer.name", "lion"], "optimizer.name = 'lion' is not a known optimizer (use AdamW, Adam, SGD or Muon)"),
    (["--training.batch_size", "0"], "training.batch_size = 0 must be >= 1"),
    (["--training.seq_len", "0"], "training.seq_len = 0 must be >= 1"),
    (["--training.max_steps", "0"], "training.max_steps = 0 must be >= 1"),
    (["--training.gradient_accumulation_steps", "0"], "training.gradient_accumulation_steps = 0 must be >= 1"),
    (["--training.dtype", "int8"], "training.dtype = 'int8' is not a known dtype (use bf16, fp16 or fp32)"),
    (["--lr_scheduler.decay_type", "step"], "lr_scheduler.decay_type = 'step' is not a known decay type"),
    (["--lr_scheduler.min_lr_ratio", "1.5"], "lr_scheduler.min_lr_ratio = 1.5 must be in [0, 1]"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps = -1 must be >= 0"),
    (["--parallel.pp_schedule", "zb"], "parallel.pp_schedule = 'zb' is not a known pipeline schedule"),
    (["--activation_checkpoint.mode", "some"], "activation_checkpoint.mode = 'some' is not a known"),
    (["--parallel.tp_degree", "0"], "parallel.tp_degree = 0 must be >= 1"),
    (["--parallel.pp_degree", "0"], "parallel.pp_degree = 0 must be >= 1"),
    (["--parallel.dp_replicate", "0"], "parallel.dp_replicate = 0 must be >= 1"),
    (["--parallel.dp_shard", "0"], "parallel.dp_shard = 0 must be -1 (all remaining ranks) or >= 1"),
    (["--parallel.dp_shard", "-2"], "parallel.dp_shard = -2 must be -1"),
    (["--parallel.pp_virtual_stages", "-1"], "parallel.pp_virtual_stages = -1 must be >= 0"),
    (["--compile.backend="], "compile.backend is empty"),
    (["--parallel.backend", "mpi"], "parallel.backend = 'mpi' is not a known backend (use auto, hccl, nccl or gloo)"),
    (["--checkpoint.keep_last_n", "0"], "checkpoint.keep_last_n = 0 must be >= 1"),
    (["--checkpoint.save_interval", "0"], "checkpoint.save_interval = 0 must be >= 1"),
    (["--checkpoint.resume="], "checkpoint.resume = '' must be auto, never, a step number or a checkpoint path"),
    (["--checkpoint.resume", "-5"], "checkpoint.resume = '-5' must be auto, never"),
    (["--metrics.log_interval", "0"], "metrics.log_interval = 0 must be >= 1"),
    (["--metrics.spike_window", "0"], "metrics.spike_window = 0 must be >= 1"),
    (["--data.num_workers", "-1"], "data.num_workers = -1 must be >= 0"),
    (["--model.dim", "0"], "model.dim = 0 must be > 0 (leave it out to take the flavor's value)"),
    (["--model.n_layers", "-2"], "model.n_layers = -2 must be > 0 (leave it out to take the flavor's value)"),
    (["--model.norm_eps", "0"], "model.norm_eps = 0.0 must be > 0 (leave it out to take the flavor's value)"),
    (["--model.n_heads", "32", "--model.n_kv_heads", "5"], "model.n_kv_heads = 5 must divide model.n_heads = 32"),
    (["--model.flavor="], "model.flavor is empty"),
    (["--training.memory_fraction", "1.5"], "training.memory_fraction = 1.5 must be in [0, 1]"),
    (["--profiling.ranks", "0,-2"], "profiling.ranks = [0, -2] must be -1 (every rank) or >= 0"),
    (["--profiling.level", "Level9"], "profiling.level = 'Level9' is not a known profiler level"),
    (["--comm.hccl_if_base_port", "70000"],
     "comm.hccl_if_base_port = 70000 must be 0 (keep the environment's) or in [1, 65535]"),
]


@pytest.mark.parametrize(("tokens", "expected"), INVALID, ids=[" ".join(t) for t, _ in INVALID])
def test_invalid_values_are_refused_with_the_fix(tokens, expected):
    message = load_error(None, tokens)
    assert message.startswith(f"command line: {expected}")


def test_invalid_value_from_a_file_names_the_file(tmp_path):
    path = write(tmp_path, "x.toml", "[optimizer]\nlr = -0.5\n")
    assert load_error(path).startswith(f"{path}:2: optimizer.lr = -0.5 must be > 0 (a typical peak learning rate")


@pytest.mark.parametrize(("name", "text", "line", "expected"), [
    ("x.toml", "# run\n[training]\nseq_len = 32\nbatch_size = [2, 4]\n", 4,
     "training.batch_size = [2, 4] is not an int"),
    ("x.toml", "[model]\ndim = 64\n\n[training]\nbatch_size = 'two'  # per device\n", 5,
     "training.batch_size = 'two' is not an int"),
    ("x.yaml", "model:\n  dim: 64\ntraining:\n  steps: 10\n  batch_size: [2]\n", 5,
     "training.batch_size = [2] is not an int"),
    ("x.yaml", "optimizer:\n  eps: 1.0e-8\ntraining:\n  batch_size: 2\n  learning_rate: fast\n", 5,
     "training.learning_rate = 'fast' is not a float"),
])
def test_a_bad_file_value_is_named_with_its_line_even_when_the_command_line_overrides_it(tmp_path, name, text, line,
                                                                                        expected):
    path = write(tmp_path, name, text)
    key = expected.split(" = ")[0].replace("training.learning_rate", "optimizer.lr")
    assert load_error(path, [f"--{key}", "2"]) == f"{path}:{line}: {expected}"


def test_a_key_the_file_sets_twice_in_different_sections_is_found_under_its_own(tmp_path):
    path = write(tmp_path, "x.toml", "[training]\nsteps = 5\n[lr_scheduler]\nwarmup_steps = 2\n"
                                     "[validation]\nsteps = 'x'\n")
    assert load_error(path).startswith(f"{path}:6: validation.steps = 'x' is not an int")


@pytest.mark.parametrize("resume", ["auto", "never", "1000", "checkpoints/step-1000", "/abs/path"])
def test_resume_accepts_auto_never_digits_and_paths(resume):
    assert load_config(None, ["--checkpoint.resume", resume]).checkpoint.resume == resume


@pytest.mark.parametrize("ranks", ["[]", "-1", "0,3"])
def test_profiling_ranks_accept_every_rank_markers(ranks):
    load_config(None, ["--profiling.ranks", ranks])


def test_validate_checks_a_config_built_in_code():
    cfg = JobConfig()
    cfg.training.seq_len = "64"  # type: ignore[assignment]
    cfg.model.name = "llama2_13b"
    validate(cfg)
    assert cfg.training.seq_len == 64
    assert (cfg.model.name, cfg.model.flavor) == ("llama2", "13B")
    cfg.training.batch_size = 0
    with pytest.raises(ConfigError, match=r"^training.batch_size = 0 must be >= 1"):
        validate(cfg)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["--data.reset_position_ids=true"], "data.reset_position_ids = true restarts positions at document starts, "
                                         "which needs data.document_mask = true; set both or neither"),
])
def test_document_masking_settings_that_cannot_run_are_refused_in_one_line(overrides, expected):
    assert expected in load_error(None, overrides)


@pytest.mark.parametrize("layout", [["--parallel.cp_degree=2"], ["--parallel.tp_degree=2"],
                                    ["--parallel.tp_degree=2", "--parallel.cp_degree=2"], ["--parallel.pp_degree=2"]])
def test_document_masking_with_context_tensor_or_pipeline_parallelism_is_accepted(layout):
    cfg = load_config(None, ["--data.document_mask=true", "--data.reset_position_ids=true", *layout])
    assert cfg.data.document_mask and cfg.data.reset_position_ids

"""Bad input to plan, doctor, generate and report: every input proceeds or is refused in bounded time, in one line
(exit 2), and an output that is cut or an input that is ignored says so (exit 0 with one warning line).

The cases that used to hang (a hint built by counting up to model.n_heads, a plan search over the divisors of an
absurd world size) run in real processes under a generous timeout: finishing is what they show.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import refusal_line, train_tiny

from titan_npu.cli import main as cli_main
from titan_npu.intmath import HINT_COUNT, divisor_hint, divisors

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "configs" / "debug.toml")
RECORDED = REPO / "tests" / "metrics" / "data" / "recorded_run"




def _titan(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "titan_npu.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


# ------------------------------------------------------------------------------------------------ bounded time
def test_divisors_are_exact_and_hints_are_the_smallest_few_for_any_size():
    for n in range(1, 400):
        every = [d for d in range(1, n + 1) if n % d == 0]
        assert divisors(n) == every
        assert divisor_hint(n) == every[:HINT_COUNT]
    assert divisor_hint(1_000_000_007) == [1, 1_000_000_007]
    assert divisor_hint(10**30)[:4] == [1, 2, 4, 5] and len(divisor_hint(10**30)) == HINT_COUNT
    assert divisor_hint(2**127 - 1) == [1, 2**127 - 1]  # a prime far past any trial division: listed, not searched


@pytest.mark.parametrize("args, code, said", [
    (["plan", "--config", DEBUG, "--model.n_heads", "1000000007", "--model.n_kv_heads", "2"], 2,
     "model.n_kv_heads = 2 must divide model.n_heads = 1000000007 (query heads are shared evenly by the kv heads; "
     "use 1 or 1000000007)"),
    (["plan", "--config", DEBUG, "--nodes", "1000000000"], 2,
     "--nodes = 1000000000 is above 65,536, the most nodes the planner plans (docs/planning.md)"),
    (["plan", "--config", DEBUG, "--devices-per-node", "100000000"], 2,
     "--devices-per-node = 100000000 is above 1,024, the most devices per node the planner plans"),
    (["plan", "--config", DEBUG, "--model.n_layers", "1000000000"], 2,
     "model.n_layers = 1000000000: the planner adds up its estimates layer by layer and plans models of at most "
     "10,000 layers"),
    (["train", "--config", DEBUG, "--dry-run", "--world-size", "1000000000000"], 2,
     "a dry run of 1,000,000,000,000 ranks: it builds jobs of at most 65,536 ranks"),
    # 40,320 ranks have 96 divisors: the search used to try millions of layouts (minutes); now seconds.
    (["plan", "--config", DEBUG, "--nodes", "5040", "--top", "1"], 0, "to use #1:"),
], ids=["n_heads a large prime", "absurd node count", "absurd devices per node", "absurd layer count",
        "absurd dry-run world", "a highly composite world size"])
def test_an_absurd_number_is_refused_or_planned_in_bounded_time(tmp_path, args, code, said):
    proc = _titan(args, tmp_path)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    if code == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], proc.stderr
    else:
        assert said in proc.stdout
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("value, said", [
    ("0GB", "--device-memory '0GB': a device's memory must be positive"),
    ("0", "--device-memory '0': a device's memory must be positive"),
    ("-5GB", "--device-memory '-5GB': a device's memory must be positive"),
    ("99999999TB", "--device-memory '99999999TB' is more than any device holds (at most 16 TiB here)"),
])
def test_plan_refuses_a_device_memory_that_is_not_positive_or_absurd(capsys, value, said):
    line = refusal_line(capsys, ["plan", "--config", DEBUG, f"--device-memory={value}"])
    assert line.startswith(f"ConfigError: {said}"), line


def test_a_negative_value_written_after_a_space_is_answered_with_the_spelling_that_works(capsys):
    line = refusal_line(capsys, ["plan", "--config", DEBUG, "--device-memory", "-5GB"])
    assert "(if its value starts with '-', write --device-memory=VALUE)" in line, line


@pytest.mark.parametrize("name", ["mindspeed_llama2_13b_tp8", "`mindspeed_llama2_13b_tp8`",
                                  "mindspeed_llama2_13b_tp8.toml"])
def test_plan_reproduce_accepts_a_run_by_the_name_its_table_prints(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)  # the name is found beside the package, not only from the repository root
    assert cli_main(["plan", "--reproduce", name]) == 0
    assert capsys.readouterr().out.startswith("published run mindspeed_llama2_13b_tp8 (MindSpeed-LLM)")


def test_plan_reproduce_of_an_unknown_name_lists_the_runs(capsys):
    line = refusal_line(capsys, ["plan", "--reproduce", "llama_bogus"])
    assert line.startswith("ConfigError: --reproduce llama_bogus: no such file, nor a published run of that name in ")
    assert "give a file or one of: mindspeed_llama2_13b_tp8, " in line and "torchtitan_llama3_8b_fsdp8" in line


@pytest.mark.parametrize("argv, said", [
    (["plan", "--config", DEBUG, "--efficiency", "nan"], "--efficiency = nan must be a finite number in (0, 1]"),
    (["plan", "--config", DEBUG, "--intra-node-bw", "inf"], "--intra-node-bw = inf must be a finite number > 0"),
    (["doctor", "--timeout", "inf"], "--timeout = inf must be a finite number > 0"),
    (["doctor", "--timeout", "1e9"], "--timeout = 1000000000.0 is above 86,400, a day: check the value"),
    (["doctor", "--iters", "1000000000"], "--iters = 1000000000 is above 1,000, the most a check needs"),
    (["generate", "--checkpoint", "x.pt", "--top-p", "nan"], "--top-p = nan must be a finite number in (0, 1]"),
    (["generate", "--checkpoint", "x.pt", "--temperature", "inf"], "--temperature = inf must be a finite number >= 0"),
], ids=["nan efficiency", "infinite bandwidth", "infinite timeout", "absurd timeout", "absurd iterations", "nan top-p",
        "infinite temperature"])
def test_a_command_number_that_is_not_finite_or_absurd_is_refused_in_one_line(capsys, argv, said):
    line = refusal_line(capsys, argv)
    assert line.startswith(f"ConfigError: {said}"), line


# ----------------------------------------------------------------------------------------------------- doctor
@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5", ""])
def test_doctor_says_an_unparsable_omp_num_threads_is_ignored_and_what_torch_does(monkeypatch, capsys, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    cli_main(["doctor", "--no-collectives"])
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if "[warn]" in line and "OMP_NUM_THREADS" in line]
    assert len(warned) == 1, out
    assert f"OMP_NUM_THREADS={value!r} is unparsable" in warned[0]
    assert "OpenMP ignores it and torch runs its default, one thread per available core" in warned[0]


@pytest.mark.parametrize("value", ["4", "4,2"])
def test_doctor_accepts_an_omp_num_threads_openmp_reads(monkeypatch, capsys, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    cli_main(["doctor", "--no-collectives"])
    assert "unparsable" not in capsys.readouterr().out


@pytest.mark.parametrize("sizes", ["inf", "nan", "1e30", "0", "-1"])
def test_doctor_refuses_collective_sizes_that_are_not_positive_or_absurd(capsys, sizes):
    line = refusal_line(capsys, ["doctor", f"--sizes={sizes}"])
    assert line.startswith(f"ConfigError: --sizes {sizes!r} must be positive MiB values up to 16384")


# ----------------------------------------------------------------------------------------------------- report
def test_report_skips_a_non_utf8_line_of_metrics_and_names_it(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 99, "loss": 1.0, "note": "caf\xe9"}\n')
    number = (run / "metrics.jsonl").read_bytes().count(b"\n")
    assert cli_main(["report", str(run), "--no-plots"]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "metrics.jsonl" in line]
    assert len(warned) == 1 and "Traceback" not in err, err
    assert f"{run / 'metrics.jsonl'}:{number}: not UTF-8 text (byte 0xe9 at column 39); skipped it" in warned[0]
    assert f"metrics.jsonl:{number}: not UTF-8" in (run / "report.md").read_text()


# --------------------------------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A one-step tiny llama3 run's DCP step (it records its model: dim 64, max_seq_len 64)."""
    return train_tiny(tmp_path_factory.mktemp("gen"), steps=1) / "step-1"


def test_generate_says_it_stopped_at_the_context_length(tiny_checkpoint, capsys):
    argv = ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "hello world", "--max-new-tokens", "500",
            "--num-samples", "4", "--seed", "0"]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "max_seq_len" in line]
    assert len(said) == 1, err
    # 12 prompt tokens (BOS + 11 bytes) in a 64-position context leave room for 53 new ones.
    assert said[0].startswith("generate: stopped at model.max_seq_len=64: the 12-token prompt left room for 53 new "
                              "tokens, so 447 of the --max-new-tokens 500 were not generated")


def test_generate_within_the_context_says_nothing_about_it(tiny_checkpoint, capsys):
    argv = ["generate", "--checkpoint", str(tiny_checkpoint), "--max-new-tokens", "5", "--seed", "0"]
    assert cli_main(argv) == 0
    assert "max_seq_len" not in capsys.readouterr().err


def test_generate_refuses_more_samples_than_their_cache_can_hold_in_one_line(tiny_checkpoint, capsys):
    line = refusal_line(capsys, ["generate", "--checkpoint", str(tiny_checkpoint), "--num-samples", "1000000000000"])
    assert line.startswith("ConfigError: --num-samples 1000000000000: the decoder's key/value cache for that many "
                           "samples does not fit in cpu memory; ask for fewer samples")


def test_generate_samples_at_a_temperature_past_float32s_range(tiny_checkpoint, capsys):
    argv = ["generate", "--checkpoint", str(tiny_checkpoint), "--temperature", "1e308", "--max-new-tokens", "3"]
    assert cli_main(argv) == 0
    assert "Error" not in capsys.readouterr().err


def test_generate_refuses_a_prompt_that_is_not_utf8_in_one_line(tiny_checkpoint, tmp_path):
    proc = _titan(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", b"caf\xe9".decode(
        "utf-8", "surrogateescape")], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "ConfigError: --prompt is not UTF-8 text (byte 0xe9 at character 4); pass the " \
                                  "prompt in UTF-8 (check the terminal's locale)"


def test_generate_refuses_a_config_of_another_family_than_the_checkpoints(tiny_checkpoint, capsys):
    moe = str(REPO / "configs" / "debug_moe.toml")
    line = refusal_line(capsys, ["generate", "--checkpoint", str(tiny_checkpoint), "--config", moe])
    assert line == (f"ConfigError: --config {moe} describes a qwen3_moe model, but {tiny_checkpoint} records a llama3 "
                    f"model; pass the config the checkpoint was trained with (or leave --config out: the checkpoint's "
                    f"own model and the config beside it are used)")


def test_generate_says_which_config_shapes_the_checkpoint_overrides(tiny_checkpoint, capsys):
    argv = ["generate", "--checkpoint", str(tiny_checkpoint), "--config", DEBUG, "--max-new-tokens", "3"]
    assert cli_main(argv) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "instead of" in line]
    assert len(said) == 1
    assert said[0].startswith(f"generate: {tiny_checkpoint} records its model's shapes, which are used instead of "
                              f"{DEBUG}'s [model]: dim 64 (config: 256), n_layers 2 (config: 4)")

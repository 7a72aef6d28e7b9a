"""`titan-npu bench` and benchmarks/compare.py: the figures they print are consistent with the steps they time,
they leave the configured run's directories alone, and the comparison alternates its candidates in paired rounds.
Speed itself belongs to the benchmarks, never to these tests."""

import contextlib
import importlib.util
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from titan_npu.commands.bench import main
from titan_npu.errors import ConfigError
from titan_npu.tools.bench import StepTimer, step_time_stats, summarize

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", "512", "--model.ffn_dim", "128", "--model.max_seq_len", "32",
        "--training.seq_len", "32", "--training.batch_size", "2", "--training.dtype", "fp32",
        "--data.num_workers", "0", "--metrics.tensorboard", "false", "--metrics.log_interval", "2"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_bench_json(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--json", *args]) == 0
    return json.loads(out.getvalue())


def test_step_time_stats_give_median_extremes_and_the_middle_80_percent_spread():
    st = step_time_stats([0.5, 0.1, 0.2, 0.3, 0.4])
    assert (st.median, st.min, st.max) == (0.3, 0.1, 0.5)
    assert st.mean == pytest.approx(0.3)
    assert (st.p10, st.p90) == (pytest.approx(0.14), pytest.approx(0.46))
    assert st.spread == pytest.approx((0.46 - 0.14) / 0.3)


def test_summary_leaves_out_the_warmup_steps():
    times, tokens_per_s, tflops, mfu = summarize([10.0, 1.0, 1.0, 2.0], warmup=1, tokens_per_step=100,
                                                 world_size=2, flops_per_token=1e9, peak_flops=1e12)
    assert tokens_per_s == pytest.approx(300 / 4)  # 3 measured steps of 100 tokens in 4 s
    assert tflops == pytest.approx(300 / 4 / 2 * 1e9 / 1e12)  # per device
    assert mfu == pytest.approx(tflops)  # a 1 TFLOP/s peak
    assert times.max == 2.0
    with pytest.raises(ValueError, match="none after the 4 warm-up steps"):
        summarize([1.0] * 4, warmup=4, tokens_per_step=1, world_size=1, flops_per_token=1, peak_flops=1)


def test_step_timer_counts_each_step_from_the_end_of_the_previous_one():
    ticks = iter([1.0, 1.5, 3.5, 4.0])
    syncs = []
    timer = StepTimer(lambda: syncs.append(1), clock=lambda: next(ticks))
    timer.start()
    for step in (1, 2, 3):
        timer(step)
    assert timer.durations() == [0.5, 2.0, 0.5]
    assert len(syncs) == 4  # the device is synchronised before every clock reading


def test_bench_reports_throughput_mfu_and_memory_consistent_with_its_step_times():
    r = run_bench_json([*TINY, "--steps", "3", "--warmup", "1"])
    assert (r["steps"], r["warmup"], r["world_size"], r["device"]) == (3, 1, 1, "cpu")
    assert r["tokens_per_step"] == 2 * 32
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time"]["mean"])
    assert r["tokens_per_s_per_device"] == r["tokens_per_s"]
    assert r["mfu"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops"])
    assert r["step_time"]["min"] <= r["step_time"]["median"] <= r["step_time"]["max"]
    assert r["peak_memory_gb"] > 0.05  # a python process holding torch
    assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
    assert r["params"] == 139_584  # 2 x 64 x 512 embeddings + 2 blocks of 36,992 + the final norm
    assert r["dtype"] == "fp32" and r["mixed_precision"] is True


def test_bench_writes_no_checkpoint_and_no_logs_into_the_configured_run_directories(tmp_path):
    config = tmp_path / "run.toml"
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    config.write_text(f'[checkpoint]\ndir = "{ckpt}"\nsave_interval = 1\n[metrics]\nlog_dir = "{logs}"\n')
    r = run_bench_json(["--config", str(config), *TINY, "--steps", "2", "--warmup", "1"])
    assert r["steps"] == 2
    assert not ckpt.exists() and not logs.exists()


def test_bench_prints_a_readable_report():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*TINY, "--steps", "2", "--warmup", "1", "--training.dtype", "bf16",
              "--training.mixed_precision", "false"])
    text = out.getvalue()
    for label in ("throughput", "tokens/s global", "mfu", "step time", "median", "peak memory", "bf16 pure"):
        assert label in text


def test_bench_refuses_zero_measured_steps():
    with pytest.raises(ConfigError, match=r"^--steps = 0 must be >= 1 \(measured steps\)$"):
        main([*TINY, "--steps", "0"])


@pytest.mark.parametrize("override, error", [
    (["--data.tokenizer", "/models/nope/tokenizer.model"], "tokenizer '/models/nope/tokenizer.model' not found"),
    (["--training.seq_len", "64"], "training.seq_len=64 exceeds model.max_seq_len=32"),
])
def test_bench_refuses_what_train_refuses_before_any_process_group_forms(monkeypatch, override, error):
    """As `train.py`: under torchrun a refusal found before the process group is said once, not by every rank."""
    import titan_npu.trainer.trainer as trainer_module
    from titan_npu.errors import TitanError

    def no_process_group(*args, **kwargs):
        raise AssertionError("bench formed a process group before refusing the config")

    monkeypatch.setattr(trainer_module, "init_process_group", no_process_group)
    with pytest.raises(TitanError, match=error) as caught:
        main([*TINY, *override])
    assert caught.value.same_on_every_rank


def test_pure_bf16_holds_weights_and_optimizer_state_in_bf16_and_rope_tables_in_fp32(tmp_path):
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    cfg = load_config(None, [*TINY, "--training.dtype", "bf16", "--training.mixed_precision", "false",
                             "--training.max_steps", "1", "--checkpoint.enable", "false",
                             "--metrics.log_dir", str(tmp_path), "--metrics.report", "false"])
    trainer = Trainer(cfg)
    try:
        trainer.train()
        assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
        states = [s for s in trainer.optimizer.state.values()]
        assert states and all(s["exp_avg"].dtype == torch.bfloat16 for s in states)
        assert trainer.model.freqs_cos.dtype == torch.float32
    finally:
        trainer.close()


def test_pure_fp16_is_refused_with_the_fix():
    from titan_npu.trainer.precision import pure_param_dtype

    assert pure_param_dtype("bf16", mixed_precision=True) is None
    assert pure_param_dtype("fp32", mixed_precision=False) is None
    with pytest.raises(ConfigError, match="needs training.dtype=bf16"):
        pure_param_dtype("fp16", mixed_precision=False)


def test_plain_loops_build_the_same_model_size_for_ours_and_transformers():
    bare = _load("bare_loop")
    shape = bare.SHAPES["tiny"]
    ours = bare.build_loop("ours", shape, "fp32", torch.device("cpu"))
    hf = bare.build_loop("hf", shape, "bf16-pure", torch.device("cpu"))
    count = lambda loop: sum(p.numel() for p in loop.model.parameters())  # noqa: E731
    assert count(ours) == count(hf) == bare.llama_args(shape).num_params()
    for loop in (ours, hf):
        first = float(loop.step())
        assert abs(first - math.log(shape.vocab_size)) < 1.0  # near-uniform predictions at initialisation
    assert {p.dtype for p in hf.model.parameters()} == {torch.bfloat16}


def test_reference_shapes_have_the_stated_sizes():
    bare = _load("bare_loop")
    assert bare.llama_args(bare.SHAPES["S1"]).num_params() == 6_163_712
    assert bare.llama_args(bare.SHAPES["S2"]).num_params() == 35_660_288


def test_paired_ratios_divide_within_each_round():
    compare = _load("compare")
    ratios = compare.paired_ratios({"a": [2.0, 3.0], "ref": [1.0, 6.0]}, "ref")
    assert ratios == {"a": [2.0, 0.5], "ref": [1.0, 1.0]}


def test_compare_alternates_candidates_in_paired_rounds_on_a_tiny_model(tmp_path, capsys):
    compare = _load("compare")
    out = tmp_path / "result.json"
    md = tmp_path / "table.md"
    assert compare.main(["--shapes", "tiny", "--dtypes", "bf16", "--candidates", "titan", "bare",
                         "--windows", "2", "--steps", "1", "--warmup", "1", "--pause", "0", "--peak-n", "256",
                         "--json", str(out), "--markdown", str(md)]) == 0
    group = json.loads(out.read_text())["groups"][0]
    assert (group["shape"], group["dtype"], group["reference"]) == ("tiny", "bf16", "bare")
    assert len(group["peaks_tflops_per_round"]) == 2
    by_name = {r["candidate"]: r for r in group["results"]}
    assert set(by_name) == {"titan", "bare"}
    assert by_name["bare"]["ratio"] == [1.0, 1.0, 1.0]
    for r in by_name.values():
        assert len(r["windows_tokens_per_s"]) == 2 and min(r["windows_tokens_per_s"]) > 0
        assert r["peak_memory_gb"] > 0.05
    assert "| titan |" in md.read_text() and "tiny bf16" in capsys.readouterr().out


def test_cpu_bf16_support_is_read_from_the_instruction_flags():
    from titan_npu.ops.cpu import cpu_has_native_bf16

    assert cpu_has_native_bf16("processor: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n") is False
    assert cpu_has_native_bf16("flags\t\t: fpu avx512f avx512_bf16 amx_tile\n") is True
    assert cpu_has_native_bf16("Features\t: fp asimd bf16 sve\n") is True  # Arm
    assert cpu_has_native_bf16("model name: unknown\n") is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")
def test_interference_counts_cpu_used_outside_the_watched_process_tree():
    import subprocess
    import time

    compare = _load("compare")
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch = compare.Interference(idle.pid)
        burner = subprocess.run([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1: pass"])
        assert burner.returncode == 0
        time.sleep(0.1)
        # One core of the machine busy for ~1 s of the window, none of it in the watched (sleeping) tree.
        assert watch.share() >= 0.25 / (os.cpu_count() or 1)
        assert compare.tree_jiffies(os.getpid()) > 0  # this test process has run
    finally:
        idle.kill()
        idle.wait()


def test_cpu_speed_hints_name_the_faster_setting():
    from titan_npu.config.loader import load_config
    from titan_npu.trainer.advice import speed_hints

    assert speed_hints(load_config(None, ["--data.num_workers", "0", "--training.dtype", "fp32"]), "cpu") == []
    hints = speed_hints(load_config(None, ["--data.num_workers", "2", "--training.dtype", "fp32"]), "cpu")
    assert len(hints) == 1 and "data.num_workers=0" in hints[0]
    assert speed_hints(load_config(None, ["--data.num_workers", "2"]), "cuda") == []


def _device_mfu(tmp_path, *extra: str) -> dict:
    """benchmarks/device_mfu.sh --json on the tiny shape (compiled by dynamo's eager backend); its summary."""
    import subprocess

    tiny = [a for a in TINY if a not in ("--training.dtype", "fp32")]
    env = {**os.environ, "PYTHON": sys.executable, "STEPS": "2", "WARMUP": "1"}
    env.pop("PYTHONPATH", None)  # the script puts the checkout on the path itself
    cmd = ["bash", str(ROOT / "benchmarks" / "device_mfu.sh"), "--json", *tiny, "--compile.backend", "eager",
           "--metrics.peak_tflops", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_device_mfu_benchmark_runs_compiled_and_eager_on_a_tiny_shape(tmp_path):
    """benchmarks/device_mfu.sh end to end on the cpu, the 1B config shrunk (and compiled by dynamo's eager
    backend, which traces like inductor without generating code), so the GPU benchmark cannot rot; the float8
    column says why it was not run (the cpu has no float8 peak)."""
    s = _device_mfu(tmp_path)
    assert s["compiled"]["compiled"] is True and s["eager"]["compiled"] is False
    assert (s["seq_len"], s["batch_size"], s["dtype"], s["device"]) == (32, 2, "bf16", "cpu")
    assert s["compiled"]["tokens_per_step"] == 2 * 32  # one micro-batch per step
    assert s["compile_speedup"] == pytest.approx(s["tokens_per_s"] / s["eager_tokens_per_s"])
    assert s["mfu"] == pytest.approx(s["tflops_per_device"] / s["peak_tflops"]) and s["peak_tflops"] == 1
    assert s["peak_memory_gb"] > 0 and s["attention"] == "cpu"
    assert not s["float8_run"] and "has no float8 peak" in s["float8_not_run"]
    mfu = _load("device_mfu")
    for label in ("tokens/s", "MFU", "peak memory", "compile speed-up", "attention", "float8            not run"):
        assert label in mfu.format_summary(s)


@pytest.mark.slow
def test_device_mfu_float8_column_runs_in_emulation(tmp_path):
    """The float8 column's run (compiled, float8.enable) end to end in torchao's emulation: a third compiled run,
    over a minute on 2 cores, hence -m slow."""
    pytest.importorskip("torchao.float8")
    s = _device_mfu(tmp_path, "--float8", "emulate", "--float8.auto_filter_small_kn", "false")
    assert s["float8_run"] and s["float8"]["compiled"] is True and s["float8_emulated"]
    assert s["float8_speedup"] == pytest.approx(s["float8_tokens_per_s"] / s["tokens_per_s"])
    assert s["float8_mfu"] is None and s["float8_peak_memory_gb"] > 0  # the cpu has no float8 peak
    assert "emulated" in _load("device_mfu").format_summary(s)


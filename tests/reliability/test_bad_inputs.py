"""Bad input is refused before any work: exit code 2, one line (at most three) naming the value and the fix, no
traceback, and nothing on disk changed (no log or checkpoint folder, every existing file as it was, by checksum).

Two tables: training runs (config, data, checkpoints, launch environment, signals) through `titan-npu train`, and
the other commands (export, import, generate, prepare-data, report, the dispatcher). Every case runs in-process
through titan_npu.cli.main (fast); the cases that need a real checkpoint share one tiny two-step run. A handful
run `python train.py` or torchrun in real processes to show the exit code, the missing traceback and rank 0.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tiny_run import train_tiny

from titan_npu.cli import main as cli_main

from .conftest import REPO, clean_env, run_train, snapshot, tiny_args, torchrun


@dataclass
class Case:
    id: str
    args: list[str]  # overrides on top of the tiny run; {d} = the case's folder
    error: str  # the error type the line starts with
    message: str  # a regex the rest of the line matches: the problem and the fix
    setup: Callable[[Path], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    hook: tuple[str, str] | None = None  # (module, function) that receives a real SIGINT instead of running
    code: int = 2


def _write(rel: str, text: str | bytes) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        path = d / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def _tokens(rows: list[dict], tail: str = "") -> Callable[[Path], None]:
    return _write("t.jsonl", "".join(json.dumps(r) + "\n" for r in rows) + tail)


DOC = list(range(1, 200))


def _truncated_shards(d: Path) -> None:
    (d / "corpus.txt").write_text("\n\n".join(f"document {i} " + "words and more words " * 40 for i in range(12)))
    assert cli_main(["prepare-data", str(d / "corpus.txt"), "--output", str(d / "shards"), "--tokenizer", "byte",
                     "--shard-size", "3000", "--progress", "lines"]) == 0
    shard = d / "shards" / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:100])  # a copy that stopped half-way


def _checkpoint(d: Path) -> None:
    shutil.copytree(_TRAINED[0], d / "ckpt" / _TRAINED[0].name)


def _run_copy(d: Path) -> None:
    """The whole trained run at d: ckpt/step-1, ckpt/step-2 and logs/."""
    shutil.copytree(_TRAINED[0].parent.parent, d, dirs_exist_ok=True)


def _damaged(rel: str, damage: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        _run_copy(d)
        damage(d / "ckpt" / rel)
    return setup


def _legacy(setup: Callable[[Path], None]) -> Callable[[Path], None]:
    """The run's checkpoints as saved before checkpoint.json recorded digests (the rank file is read to find out)."""
    def legacy(d: Path) -> None:
        setup(d)
        for info in (d / "ckpt").glob("step-*/checkpoint.json"):
            info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "files"}))
    return legacy


def _cut(size: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        with open(path, "r+b") as f:
            f.truncate(size)
    return damage


def _pickled_object(path: Path) -> None:
    torch.save({"rng": torch.nn.Linear(1, 1)}, path)  # an object, not tensors and plain values


def _both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        for one in setups:
            one(d)
    return setup


def _checkpoint_without_info(d: Path) -> None:
    target = d / "old" / "step-3"
    shutil.copytree(_TRAINED[0], target)
    (target / "checkpoint.json").unlink()  # the save was cut before its last file


def _hf_dir(d: Path) -> None:
    from safetensors.torch import save_file

    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    save_file({"model.embed_tokens.weight": torch.zeros(512, 64)}, str(d / "hf" / "model.safetensors"))


def _torch_npu_for_another_torch(d: Path) -> None:
    # Package metadata is all the version check reads before importing torch_npu: an install built for torch 2.1.
    meta = d / "site" / "torch_npu-2.1.0.post3.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.1.0.post3\n")


CASES = [
    # ---- configs
    Case("unknown-key", ["--training.bogus", "1"], "ConfigError", r"unknown key 'training.bogus' \(see docs/config"),
    Case("ft-replica-id-outside", ["--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", "2",
                                   "--fault_tolerance.num_replica_groups", "2"], "ConfigError",
         r"fault_tolerance.replica_id = 2 is outside num_replica_groups = 2; give each group an id in 0..1"),
    Case("ft-min-replicas-too-many", ["--fault_tolerance.enable", "true", "--fault_tolerance.min_replicas", "3",
                                      "--fault_tolerance.num_replica_groups", "2"], "ConfigError",
         r"fault_tolerance.min_replicas = 3 is more than num_replica_groups = 2; no step could commit"),
    Case("ft-with-dp-replicate", ["--fault_tolerance.enable", "true", "--parallel.dp_replicate", "2"], "ConfigError",
         r"parallel.dp_replicate = 2 with fault_tolerance.enable: the replicas are the replica groups"),
    Case("ft-no-lighthouse", ["--fault_tolerance.enable", "true"], "ConfigError",
         r"fault_tolerance.lighthouse is not set \(nor TORCHFT_LIGHTHOUSE\); give the address"),
    Case("unknown-section", ["--config", "{d}/c.toml"], "ConfigError", r"unknown section 'trainig' \(did you mean",
         _write("c.toml", "[trainig]\nbatch_size = 2\n")),
    Case("key-in-wrong-section", ["--training.lr", "1e-3"], "ConfigError", r"unknown key 'training.lr'.*optimizer"),
    Case("wrong-type", ["--training.batch_size", "two"], "ConfigError", r"training.batch_size = 'two' is not an int"),
    Case("negative-lr", ["--optimizer.lr", "-1e-3"], "ConfigError", r"optimizer.lr = -0.001 must be > 0 \(a typical"),
    Case("zero-batch", ["--training.batch_size", "0"], "ConfigError", r"training.batch_size = 0 must be >= 1"),
    Case("bad-betas", ["--optimizer.betas", "[0.9, 1.5]"], "ConfigError",
         r"optimizer.betas = \[0.9, 1.5\] must be in \[0, 1\)"),
    Case("unknown-dtype", ["--training.dtype", "fp8"], "ConfigError", r"training.dtype = 'fp8' is not a known dtype"),
    Case("unknown-optimizer", ["--optimizer.name", "Lion"], "ConfigError", r"optimizer.name = 'Lion' .*use AdamW"),
    Case("negative-resume", ["--checkpoint.resume", "-3"], "ConfigError", r"checkpoint.resume = '-3' must be auto"),
    Case("config-not-found", ["--config", "{d}/nope.toml"], "ConfigError", r"nope.toml' not found \(check the path"),
    Case("config-extension", ["--config", "{d}/c.json"], "ConfigError", r"unsupported extension '.json' \(use .toml",
         _write("c.json", "{}")),
    Case("invalid-toml", ["--config", "{d}/c.toml"], "ConfigError", r"c.toml: invalid TOML: .*line 2",
         _write("c.toml", "[training]\nbatch_size = = 2\n")),
    Case("unknown-model", ["--model.name", "gpt5"], "ConfigError", r"model.name = 'gpt5' is not a known model \(use"),
    Case("unknown-flavor", ["--model.flavor", "13B"], "ConfigError", r"model.flavor='13B' is not a llama3 flavor"),
    Case("kv-heads", ["--model.n_kv_heads", "3"], "ConfigError", r"n_kv_heads = 3 must divide model.n_heads = 4"),
    Case("seq-len-over-max", ["--training.seq_len", "128"], "ConfigError",
         r"training.seq_len=128 exceeds model.max_seq_len=64; lower training.seq_len or raise"),
    Case("impossible-layout", ["--parallel.tp_degree", "2"], "LayoutError",
         r"world size 1 is not divisible by .* = 2; choose degrees"),
    Case("fp16-on-cpu", ["--training.dtype", "fp16"], "ConfigError", r"fp16 on a CPU: .*use training.dtype = fp32"),
    Case("reliability-setting", ["--reliability.max_skipped_steps", "0"], "ConfigError",
         r"reliability.max_skipped_steps = 0 must be >= 1"),
    Case("tokenizer-vocab", ["--model.vocab_size", "128"], "DataError",
         r"tokenizer byte has 258 ids but model.vocab_size is 128; set model.vocab_size >= 258"),
    Case("tokenizer-missing", ["--data.tokenizer", "{d}/tok/tokenizer.json"], "DataError",
         r"tokenizer.json' not found: use 'byte'"),
    Case("data-missing", ["--data.path", "{d}/corpus"], "DataError", r"corpus does not exist; set data.path"),
    Case("data-under-one-batch", ["--data.path", "{d}/t.jsonl"], "DataError",
         r"fewer than one global batch .* use more data or a smaller batch_size", _tokens([{"tokens": DOC[:10]}])),
    # ---- data
    Case("malformed-jsonl", ["--data.path", "{d}/t.jsonl"], "DataError", r"t.jsonl:2: malformed JSON .*fix or remove",
         _tokens([{"tokens": DOC}], tail='{"tokens": [1, 2,\n')),
    Case("wrong-token-field", ["--data.path", "{d}/t.jsonl"], "DataError",
         r"t.jsonl:1: no 'text' field \(fields: ids\); set --text-field", _tokens([{"ids": DOC}] * 3)),
    Case("ids-over-vocab", ["--data.path", "{d}/t.jsonl"], "DataError",
         r"holds token id 900 but model.vocab_size is 512; set model.vocab_size > 900 or re-tokenise",
         _tokens([{"tokens": DOC + [900]}] * 3)),
    Case("truncated-shard", ["--data.path", "{d}/shards"], "DataError", r"shard_00001.bin .*re-run", _truncated_shards),
    Case("empty-corpus", ["--data.path", "{d}/empty.txt"], "DataError", r"empty.txt holds no documents; check",
         _write("empty.txt", "\n\n")),
    # ---- checkpoints
    Case("checkpoint-other-size", ["--model.dim", "128"], "CheckpointError",
         r"does not fit the model: .*\(512, 64\) vs model \(512, 128\)", _checkpoint),
    Case("checkpoint-incomplete", ["--checkpoint.resume", "{d}/old/step-3"], "CheckpointError",
         r"step-3 is incomplete \(its save did not finish\); use the previous checkpoint", _checkpoint_without_info),
    Case("checkpoint-pt-file", ["--checkpoint.resume", "{d}/model.pt"], "CheckpointError",
         r"model.pt is a file, not a checkpoint directory; .* go to checkpoint.initial_load", _write("model.pt", b"x")),
    Case("checkpoint-hf-dir", ["--checkpoint.resume", "{d}/hf"], "CheckpointError",
         r"hf is not a checkpoint; expected a step-N directory", _hf_dir),
    Case("checkpoint-step-missing", ["--checkpoint.resume", "7"], "CheckpointError",
         r"checkpoint step 7 in .* does not exist; complete steps there: none"),
    Case("checkpoint-never-over-existing", ["--checkpoint.resume", "never"], "CheckpointError",
         r"already holds checkpoints \(latest step 1\) and checkpoint.resume=never; set", _checkpoint),
    Case("initial-load-missing", ["--checkpoint.initial_load", "{d}/nope.pt"], "CheckpointError",
         r"nope.pt does not exist; give a Hugging Face model directory"),
    # ---- environment
    Case("port-in-use", [], "DeviceError", r"MASTER_PORT=\d+ is already in use on 127.0.0.1; choose a free port",
         env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}),
    Case("no-master-address", [], "DeviceError", r"WORLD_SIZE=2 but MASTER_ADDR is not set; launch with torchrun",
         env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}),
    Case("unknown-device", [], "DeviceError", r"TITAN_DEVICE='tpu' is not a device type", env={"TITAN_DEVICE": "tpu"}),
    Case("torch-npu-mismatch", [], "DeviceError",
         r"torch_npu 2.1.0.post3 is built for torch 2.1.0 but torch .* is installed; install the matching pair",
         _torch_npu_for_another_torch, env={"TITAN_DEVICE": "npu"}),
    Case("world-size-not-a-number", [], "DeviceError", r"WORLD_SIZE='abc' is not a whole number >= 1; launch with",
         env={"WORLD_SIZE": "abc"}),
    Case("world-size-zero", [], "DeviceError", r"WORLD_SIZE='0' is not a whole number >= 1", env={"WORLD_SIZE": "0"}),
    Case("rank-outside-world", [], "DeviceError", r"RANK=5 is not below WORLD_SIZE=2; launch with torchrun",
         env={"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}),
    Case("master-port-not-a-port", [], "DeviceError", r"MASTER_PORT='99999' is not a port \(1-65535\); choose",
         env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}),
    # a launch environment missing a variable the others imply, named before anything starts
    Case("rank-without-world-size", [], "DeviceError", r"^RANK=0 but WORLD_SIZE is not set; launch with torchrun",
         env={"RANK": "0"}),
    Case("world-without-local-rank", [], "DeviceError", r"^RANK=0 but LOCAL_RANK is not set; launch with torchrun",
         env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}),
    Case("master-address-alone", [], "DeviceError", r"^MASTER_ADDR=127.0.0.1 but RANK is not set; launch with",
         env={"MASTER_ADDR": "127.0.0.1"}),
    Case("no-master-port", [], "DeviceError", r"^WORLD_SIZE=2 but MASTER_PORT is not set; launch with torchrun",
         env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}),
    # ---- config files that set nothing: refused, not run on the defaults without a word
    Case("empty-config", ["--config", "{d}/c.toml"], "ConfigError",
         r"c.toml' sets nothing \(it is empty or holds only comments and section headers\); .* leave out --config",
         _write("c.toml", "")),
    Case("comment-only-config", ["--config", "{d}/c.yaml"], "ConfigError", r"c.yaml' sets nothing",
         _write("c.yaml", "# training:\n#   max_steps: 100\n")),
    Case("headers-only-config", ["--config", "{d}/c.toml"], "ConfigError", r"c.toml' sets nothing",
         _write("c.toml", "[training]\n\n[optimizer]\n# lr = 1e-4\n")),
    # ---- more configs
    Case("file-value-overridden", ["--config", "{d}/c.toml", "--training.batch_size", "2"], "ConfigError",
         r"c.toml:3: training.batch_size = \[2, 4\] is not an int",
         _write("c.toml", "[training]\nseq_len = 32\nbatch_size = [2, 4]\n")),
    Case("file-bad-value-line", ["--config", "{d}/c.yaml"], "ConfigError",
         r"c.yaml:4: training.max_norm = -1.0 must be >= 0", _write("c.yaml", "optimizer:\n  eps: 1.0e-8\n"
                                                                              "training:\n  max_norm: -1.0\n")),
    Case("zero-steps", ["--training.max_steps", "0"], "ConfigError", r"training.max_steps = 0 must be >= 1"),
    Case("negative-warmup", ["--lr_scheduler.warmup_steps", "-1"], "ConfigError",
         r"lr_scheduler.warmup_steps = -1 must be >= 0"),
    Case("zero-save-interval", ["--checkpoint.save_interval", "0"], "ConfigError",
         r"checkpoint.save_interval = 0 must be >= 1"),
    Case("val-fraction-over-one", ["--data.val_fraction", "1.5"], "ConfigError",
         r"data.val_fraction = 1.5 must be in \[0, 1\)"),
    Case("dim-not-multiple-of-heads", ["--model.dim", "63"], "ConfigError",
         r"model.dim = 63 must be a multiple of model.n_heads = 4"),
    Case("negative-loader-workers", ["--data.num_workers", "-1"], "ConfigError", r"data.num_workers = -1 must be >= 0"),
    Case("nan-lr", ["--optimizer.lr", "nan"], "ConfigError", r"optimizer.lr = 'nan' is not a finite number"),
    Case("disk-margin-below-one", ["--reliability.disk_margin", "0.5"], "ConfigError",
         r"reliability.disk_margin = 0.5 must be >= 1"),
    # ---- more checkpoints: every file of a checkpoint, damaged, is one line naming it and the intact step before
    Case("resume-truncated-distcp", ["--checkpoint.resume", "2"], "CheckpointError",
         r"step-2/__0_0.distcp is 1000 bytes but its index \(.metadata\) needs \d+ .* damaged: use the intact step 1 "
         r"before it \(train: --checkpoint.resume 1;", _damaged("step-2/__0_0.distcp", _cut(1000))),
    Case("resume-empty-distcp", ["--checkpoint.resume", "2"], "CheckpointError",
         r"__0_0.distcp is 0 bytes .*--checkpoint.resume 1", _damaged("step-2/__0_0.distcp", _cut(0))),
    Case("resume-truncated-metadata", ["--checkpoint.resume", "2"], "CheckpointError",
         r"step-2/.metadata is unreadable .*--checkpoint.resume 1", _damaged("step-2/.metadata", _cut(50))),
    Case("resume-empty-rank-file", [], "CheckpointError",
         r"ranks/rank-0.pt is unreadable \(EOFError: the file ends early: empty or cut short\); .*resume 1",
         _legacy(_damaged("step-2/ranks/rank-0.pt", _cut(0)))),
    Case("resume-truncated-rank-file", [], "CheckpointError",
         r"ranks/rank-0.pt is unreadable \(RuntimeError: PytorchStreamReader failed reading zip archive: failed "
         r"finding central directory\); .*--checkpoint.resume 1",
         _legacy(_damaged("step-2/ranks/rank-0.pt", _cut(100)))),
    Case("resume-rank-file-with-objects", [], "CheckpointError",
         r"rank-0.pt is unreadable \(UnpicklingError: it holds Python objects besides tensors and plain values, which "
         r"could run code when loaded\);", _legacy(_damaged("step-2/ranks/rank-0.pt", _pickled_object))),
    Case("resume-missing-rank-file", ["--checkpoint.resume", "2"], "CheckpointError",
         r"rank-0.pt is missing; .*--checkpoint.resume 1",
         _damaged("step-2/ranks/rank-0.pt", Path.unlink)),
    Case("resume-nothing-intact-before", ["--checkpoint.resume", "1"], "CheckpointError",
         r"step-1/__0_0.distcp is 10 bytes .* no earlier intact checkpoint is in .*ckpt; start again or restore",
         _both(_damaged("step-1/__0_0.distcp", _cut(10)), lambda d: shutil.rmtree(d / "ckpt" / "step-2"))),
    # ---- signals: Ctrl-C during start-up is one line, exit 130, and leaves nothing
    Case("sigint-at-start-up", [], "interrupted", r"^$",
         hook=("titan_npu.commands.launch", "check_before_process_group"), code=130),
    Case("sigint-while-data-is-read", [], "interrupted", r"^$", hook=("titan_npu.data.loader", "open_dataset"),
         code=130),
]

_TRAINED: list[Path] = []  # step-1 of one real tiny two-step run (step-2 beside it), made once for all cases


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained")
    train_tiny(run, steps=2, checkpoint__save_interval=1)
    _TRAINED[:] = [run / "ckpt" / "step-1"]
    yield
    _TRAINED.clear()


def _interrupt(*args, **kwargs):
    signal.raise_signal(signal.SIGINT)  # delivered to this (main) thread: Python raises KeyboardInterrupt here


@pytest.fixture
def held_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def ctrl_c_interrupts():
    """Python's KeyboardInterrupt handler for SIGINT, as at a terminal: a shell's background job starts with SIGINT
    ignored, and Python then installs none (the Ctrl-C cases would train on)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def distributed_env_cleared(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TITAN_DEVICE",
                 "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("TITAN_FAULT_")]:
        monkeypatch.delenv(name)


def test_the_tables_cover_at_least_sixty_bad_inputs_of_every_kind():
    assert len(CASES) + len(COMMANDS) >= 60
    assert len({c.id for c in CASES + COMMANDS}) == len(CASES) + len(COMMANDS)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line_before_anything_is_written(
        case, tmp_path, monkeypatch, capsys, trained_checkpoint, held_port, distributed_env_cleared,
        ctrl_c_interrupts):
    d = tmp_path / "case"
    d.mkdir()
    if case.setup is not None:
        case.setup(d)
    if (d / "site").is_dir():
        monkeypatch.syspath_prepend(str(d / "site"))
    for key, value in case.env.items():
        monkeypatch.setenv(key, value.format(port=held_port))
    if case.hook is not None:
        monkeypatch.setattr(importlib.import_module(case.hook[0]), case.hook[1], _interrupt)
    before = snapshot(d)
    capsys.readouterr()

    # One step at most: a case that were accepted by mistake fails fast instead of training for long.
    rc = cli_main(["train", *tiny_args(d, training__max_steps=1), *[a.replace("{d}", str(d)) for a in case.args]])

    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == case.code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    kind, _, message = lines[0].partition(": ")
    assert kind == case.error, lines[0]
    assert re.search(case.message, message), message
    assert "[Step" not in out
    after = snapshot(d)
    added = after.keys() - before.keys()  # not even the index cache a tokens JSONL gets once it is accepted
    assert not added, f"written by a refused run: {sorted(added)}"
    assert {k: after[k] for k in before} == before, "a refused run changed existing files"


# A few of the table as real processes: the exit code, the single line, and the traceback only with --debug.
# Config errors stop before torch is imported (fast); tokenizer-vocab stops after the device is set up.
@pytest.mark.parametrize("case_id", ["unknown-key", "invalid-toml", "negative-lr", "tokenizer-vocab"])
def test_a_refused_run_exits_2_with_one_line_and_no_traceback(case_id, tmp_path):
    case = next(c for c in CASES if c.id == case_id)
    if case.setup is not None:
        case.setup(tmp_path)
    before = snapshot(tmp_path)
    proc = run_train([*tiny_args(tmp_path), *[a.replace("{d}", str(tmp_path)) for a in case.args]])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"{case.error}: ")
    assert "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(tmp_path) == before


def test_the_real_commands_refuse_an_option_out_of_range_and_a_partial_launch_in_one_line(tmp_path):
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "titan_npu.cli", "generate", "--checkpoint", str(tmp_path / "ckpt"),
                           "--top-k", "-1"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "ConfigError: --top-k = -1 must be >= 0 (0 = all "
                                                                 "tokens)\n")
    proc = run_train(tiny_args(tmp_path), RANK="0")
    assert proc.returncode == 2 and "[Step" not in proc.stdout
    assert proc.stderr == ("DeviceError: RANK=0 but WORLD_SIZE is not set; launch with torchrun (it sets them), or "
                           "unset them for one process\n")
    assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback_of_a_refused_run(tmp_path):
    proc = run_train([*tiny_args(tmp_path), "--training.bogus", "1", "--debug"])
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ConfigError: command line: unknown key 'training.bogus'" in proc.stderr


# ---- under torchrun: found before the process group, said once, by local rank 0, and named in torchrun's summary

def test_under_torchrun_a_config_error_is_said_once_before_any_process_group_and_is_torchruns_root_cause(tmp_path):
    before = snapshot(tmp_path)
    proc = torchrun([*tiny_args(tmp_path), "--model.vocab_size", "100"], nproc=2, timeout=120)
    line = "DataError: tokenizer byte has 258 ids but model.vocab_size is 100; set model.vocab_size >= 258"
    said = [x for x in proc.stderr.splitlines() if x.startswith("DataError")]
    assert proc.stderr.startswith(line) and len(said) == 1, proc.stderr  # once, before anything torch or torchrun says
    root_cause = proc.stderr.split("Root Cause")[1]
    assert "  traceback : " + line in root_cause, proc.stderr  # torchrun's summary names it, not "To enable traceback"
    assert "[rank1]" not in proc.stderr and "DeviceMesh" not in proc.stderr + proc.stdout
    # torchrun ends every failed job with its own ChildFailedError summary and exit code 1, whatever the code.
    assert proc.returncode == 1 and "exitcode  : 2" in proc.stderr
    assert snapshot(tmp_path) == before


def test_a_rank_other_than_local_rank_zero_stays_silent_once_local_rank_zero_has_reported(tmp_path, monkeypatch,
                                                                                         capsys):
    from titan_npu import cli
    from titan_npu.errors import ConfigError

    def refuse(argv):
        e = ConfigError("training.batch_size = 0 must be >= 1")
        e.same_on_every_rank = True
        raise e

    attempt = tmp_path / "attempt_0"
    for rank in ("0", "1"):
        (attempt / rank).mkdir(parents=True)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    monkeypatch.setattr(cli, "PEER_REPORT_WAIT_S", 0.0)
    # Local rank 0 never reported: this rank says it, with its rank.
    assert cli.run_command(refuse, []) == cli.EXIT_REFUSED
    assert capsys.readouterr().err == "[rank1] ConfigError: training.batch_size = 0 must be >= 1\n"
    recorded = json.loads((attempt / "1" / "error.json").read_text())["message"]
    assert recorded["message"] == recorded["extraInfo"]["py_callstack"] == \
        "ConfigError: training.batch_size = 0 must be >= 1"
    # Local rank 0 has reported: silence.
    (attempt / "0" / "error.json").write_text(json.dumps(recorded))
    assert cli.run_command(refuse, []) == cli.EXIT_REFUSED
    assert capsys.readouterr().err == ""


# ---- the other commands: their outputs never touch their inputs, damaged inputs are named, flags by name

@dataclass
class Command:
    id: str
    argv: list[str]  # {d} = the case's folder
    error: str  # what the line starts with, before ': '
    message: str  # a regex the rest of the line matches: the value and the fix
    setup: Callable[[Path], None] | None = None


def _folder_of_mine(d: Path) -> None:
    (d / "mine").mkdir()
    (d / "mine" / "notes.txt").write_text("a week of notes")


def _corpus(d: Path) -> None:
    (d / "corpus").mkdir()
    (d / "corpus" / "a.txt").write_text("\n\n".join(f"document {i} with some words" for i in range(20)))


def _prepared(d: Path) -> None:
    _corpus(d)
    assert cli_main(["prepare-data", str(d / "corpus"), "--output", str(d / "prep"), "--progress", "lines"]) == 0


COMMANDS = [
    # export
    Command("export-output-is-the-checkpoint", ["export", "--checkpoint", "{d}/ckpt/step-2", "--output",
            "{d}/ckpt/step-2", "--overwrite"], "CheckpointError", r"--output .*step-2 is the checkpoint .*step-2; "
            r"choose another path", _run_copy),
    Command("export-output-holds-the-checkpoint", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/ckpt",
            "--format", "hf", "--overwrite"], "CheckpointError", r"--output .*ckpt contains the checkpoint .*step-2; "
            r"write to a path outside it", _run_copy),
    Command("export-output-inside-a-checkpoint", ["export", "--checkpoint", "{d}/ckpt/step-2", "--output",
            "{d}/ckpt/step-1/w.pt"], "CheckpointError", r"w.pt lies inside the checkpoint .*step-1", _run_copy),
    Command("export-overwrite-a-folder-of-mine", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/mine",
            "--format", "hf", "--overwrite"], "CheckpointError",
            r"--output .*mine is not an earlier export; --overwrite would delete notes.txt: move them away",
            _both(_run_copy, _folder_of_mine)),
    Command("export-pt-over-a-folder", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/mine", "--overwrite"],
            "CheckpointError", r"--output .*mine is a folder; --format pt writes one file", _both(_run_copy,
                                                                                                 _folder_of_mine)),
    Command("export-existing-output", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/mine"],
            "CheckpointError", r"--output .*mine already exists; remove it, choose another path or pass --overwrite",
            _both(_run_copy, _folder_of_mine)),
    Command("export-truncated-distcp", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/w.pt"],
            "CheckpointError", r"step-2/__0_0.distcp is 1000 bytes but its index .*use the intact step 1 before it",
            _damaged("step-2/__0_0.distcp", _cut(1000))),
    Command("export-truncated-metadata", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/w.pt"],
            "CheckpointError", r"step-2/.metadata is unreadable .*--checkpoint .*step-1\)",
            _damaged("step-2/.metadata", _cut(50))),
    Command("export-bad-shard-size", ["export", "--checkpoint", "{d}/ckpt", "--output", "{d}/hf", "--format", "hf",
            "--max-shard-size", "5XB"], "CheckpointError", r"--max-shard-size '5XB' is not a size; write e.g. 5GB",
            _run_copy),
    Command("export-step-of-a-step", ["export", "--checkpoint", "{d}/ckpt/step-2", "--step", "1", "--output",
            "{d}/w.pt"], "CheckpointError", r"step-2 is already one checkpoint; drop --step", _run_copy),
    Command("export-missing-step", ["export", "--checkpoint", "{d}/ckpt", "--step", "9", "--output", "{d}/w.pt"],
            "CheckpointError", r"checkpoint step 9 in .* does not exist; complete steps there: 1, 2", _run_copy),
    Command("export-tokenizer-missing", ["export", "--checkpoint", "{d}/ckpt", "--format", "hf", "--output",
            "{d}/hf", "--tokenizer", "{d}/nope.json"], "CheckpointError",
            r"tokenizer .*nope.json does not exist .*--tokenizer none", _run_copy),
    # import
    Command("import-output-inside-the-input", ["import", "--input", "{d}/ckpt/step-2", "--output",
            "{d}/ckpt/step-2/w.pt"], "CheckpointError", r"--output .*w.pt lies inside the input .*step-2; write to",
            _run_copy),
    Command("import-output-is-the-input", ["import", "--input", "{d}/model.pt", "--output", "{d}/model.pt",
            "--overwrite"], "CheckpointError", r"--output .*model.pt is the input .*model.pt; choose another path",
            _write("model.pt", b"x")),
    Command("import-missing-input", ["import", "--input", "{d}/nope", "--output", "{d}/w.pt"], "CheckpointError",
            r"nope does not exist"),
    Command("import-output-is-a-folder", ["import", "--input", "{d}/ckpt/step-1", "--output", "{d}/mine",
            "--overwrite"], "CheckpointError", r"--output .*mine is a directory; give a file name",
            _both(_run_copy, _folder_of_mine)),
    Command("import-pt-holding-objects", ["import", "--input", "{d}/evil.pt", "--output", "{d}/w.pt"],
            "CheckpointError", r"evil.pt is not a tensor file .*it holds Python objects besides tensors",
            lambda d: _pickled_object(d / "evil.pt")),
    Command("import-truncated-distcp", ["import", "--input", "{d}/ckpt/step-2", "--output", "{d}/w.pt"],
            "CheckpointError", r"__0_0.distcp is 0 bytes .*intact step 1", _damaged("step-2/__0_0.distcp", _cut(0))),
    # generate
    Command("generate-truncated-distcp", ["generate", "--checkpoint", "{d}/ckpt/step-2", "--max-new-tokens", "2"],
            "CheckpointError", r"__0_0.distcp is 1000 bytes .*intact step 1", _damaged("step-2/__0_0.distcp",
                                                                                     _cut(1000))),
    Command("generate-top-p", ["generate", "--checkpoint", "{d}/ckpt", "--top-p", "2"], "ConfigError",
            r"^--top-p = 2.0 must be in \(0, 1\] \(1.0 = off\)$", _run_copy),
    Command("generate-negative-temperature", ["generate", "--checkpoint", "{d}/ckpt", "--temperature", "-0.5"],
            "ConfigError", r"^--temperature = -0.5 must be >= 0 \(0 = greedy\)$", _run_copy),
    Command("generate-negative-top-k", ["generate", "--checkpoint", "{d}/ckpt", "--top-k", "-1"], "ConfigError",
            r"^--top-k = -1 must be >= 0 \(0 = all tokens\)$", _run_copy),
    Command("generate-no-samples", ["generate", "--checkpoint", "{d}/ckpt", "--num-samples", "0"], "ConfigError",
            r"^--num-samples = 0 must be >= 1", _run_copy),
    Command("generate-unknown-dtype", ["generate", "--checkpoint", "{d}/ckpt", "--dtype", "fp8"], "ConfigError",
            r"^titan-npu generate: argument --dtype: invalid choice: 'fp8'", _run_copy),
    Command("generate-missing-checkpoint", ["generate", "--checkpoint", "{d}/nope"], "CheckpointError",
            r"--checkpoint .*nope does not exist; give a .pt file or a checkpoint directory"),
    # prepare-data
    Command("prepare-workers-zero", ["prepare-data", "{d}/corpus", "--output", "{d}/out", "--workers", "0"],
            "ConfigError", r"^--workers = 0 must be >= 1 \(tokenising processes\)$", _corpus),
    Command("prepare-zero-shard-size", ["prepare-data", "{d}/corpus", "--output", "{d}/out", "--shard-size", "0"],
            "ConfigError", r"^--shard-size = 0 must be >= 1 \(tokens per shard\)$", _corpus),
    Command("prepare-negative-max-seq-len", ["prepare-data", "{d}/corpus", "--output", "{d}/out", "--format", "jsonl",
            "--max-seq-len", "-4"], "ConfigError", r"^--max-seq-len = -4 must be >= 0", _corpus),
    Command("prepare-workers-not-a-number", ["prepare-data", "{d}/corpus", "--output", "{d}/out", "--workers",
            "two"], "ConfigError", r"^titan-npu prepare-data: argument --workers: invalid int value: 'two'", _corpus),
    Command("tokenizer-vocab-too-small", ["train-tokenizer", "{d}/corpus", "--output", "{d}/tok", "--vocab-size",
            "100"], "ConfigError", r"^--vocab-size = 100 must be >= 259", _corpus),
    # plan, doctor, bench, export: their numbers, before any work
    Command("plan-efficiency-zero", ["plan", "--efficiency", "0"], "ConfigError",
            r"^--efficiency = 0.0 must be in \(0, 1\] \(the default is the device type's, fitted on published runs\)$"),
    Command("plan-no-nodes", ["plan", "--nodes", "0"], "ConfigError", r"^--nodes = 0 must be >= 1"),
    Command("plan-negative-bandwidth", ["plan", "--inter-node-bw", "-25"], "ConfigError",
            r"^--inter-node-bw = -25.0 must be > 0 \(GB/s\)$"),
    Command("plan-bad-config-key", ["plan", "--training.seq_len", "0"], "ConfigError",
            r"^command line: training.seq_len = 0 must be >= 1"),
    Command("doctor-zero-timeout", ["doctor", "--timeout", "0"], "ConfigError", r"^--timeout = 0.0 must be > 0"),
    Command("bench-no-steps", ["bench", "--steps", "0"], "ConfigError", r"^--steps = 0 must be >= 1"),
    Command("export-negative-step", ["export", "--checkpoint", "{d}/ckpt", "--step", "-1", "--output", "{d}/w.pt"],
            "ConfigError", r"^--step = -1 must be >= 0", _run_copy),
    Command("dry-run-zero-world", ["train", "--dry-run", "--world-size", "0"], "ConfigError",
            r"^--world-size = 0 must be >= 1 \(ranks of the job\)$"),
    Command("init-weights-empty-config", ["init-weights", "--config", "{d}/c.toml", "--output", "{d}/seed"],
            "ConfigError", r"c.toml' sets nothing", _write("c.toml", "# to do\n")),
    Command("prepare-output-inside-the-input", ["prepare-data", "{d}/corpus", "--output", "{d}/corpus/tokens"],
            "DataError", r"--output .*corpus/tokens lies inside the input .*corpus; write to a folder outside",
            _corpus),
    Command("prepare-output-holds-the-input", ["prepare-data", "{d}/corpus/a.txt", "--output", "{d}"], "DataError",
            r"--output .* holds the input .*a.txt", _corpus),
    Command("prepare-input-is-our-output", ["prepare-data", "{d}/prep/index.json", "--output", "{d}/again"],
            "DataError", r"input .*prep/index.json is a prepare-data output \(.*prep\), not a corpus", _prepared),
    Command("prepare-missing-input", ["prepare-data", "{d}/nope.txt", "--output", "{d}/out"], "DataError",
            r"input .*nope.txt does not exist; check the path"),
    Command("prepare-unsupported-input", ["prepare-data", "{d}/table.csv", "--output", "{d}/out"], "DataError",
            r"table.csv: unsupported input type; use .txt, .jsonl", _write("table.csv", "a,b\n")),
    Command("prepare-foreign-output", ["prepare-data", "{d}/corpus", "--output", "{d}/mine"], "DataError",
            r"--output .*mine is not empty and not a prepare-data output", _both(_corpus, _folder_of_mine)),
    Command("prepare-bad-record-deep-output", ["prepare-data", "{d}/bad.jsonl", "--output", "{d}/new/deep/out"],
            "DataError", r"bad.jsonl:2: 'text' is a int, not a string", _write("bad.jsonl",
                                                                                '{"text": "ok"}\n{"text": 5}\n')),
    # report
    Command("report-missing-log-dir", ["report", "{d}/nope", "--no-plots"], "DataError", r"nope"),
    Command("report-out-is-a-file", ["report", "{d}/logs", "--out", "{d}/logs/metrics.jsonl", "--no-plots"],
            "DataError", r"--out .*metrics.jsonl is a file; name a folder", _run_copy),
    Command("report-out-holds-a-report-of-mine", ["report", "{d}/logs", "--out", "{d}/mine", "--no-plots"],
            "DataError", r"--out .*mine holds a report.md that titan-npu report did not write; move it away",
            _both(_run_copy, _folder_of_mine, _write("mine/report.md", "# my own notes\n"))),
    Command("report-out-inside-a-checkpoint", ["report", "{d}/logs", "--out", "{d}/ckpt/step-2", "--no-plots"],
            "DataError", r"--out .*step-2 is the checkpoint .*step-2; write the report elsewhere", _run_copy),
    # the dispatcher
    Command("unknown-command", ["exprot", "--checkpoint", "{d}"], "titan-npu",
            r"unknown command 'exprot' \(did you mean 'export'\?\)"),
]


@pytest.mark.parametrize("case", COMMANDS, ids=[c.id for c in COMMANDS])
def test_a_bad_command_input_is_refused_in_one_line_and_changes_nothing(case, tmp_path, capsys, trained_checkpoint,
                                                                       distributed_env_cleared, one_thread):
    d = tmp_path / "case"
    d.mkdir()
    if case.setup is not None:
        case.setup(d)
    before = snapshot(d)
    capsys.readouterr()

    rc = cli_main([a.replace("{d}", str(d)) for a in case.argv])

    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert 1 <= len(lines) <= 3 and "Traceback" not in out + err, err
    kind, _, message = lines[0].partition(": ")
    assert kind == case.error, lines[0]
    assert re.search(case.message, message), message
    assert snapshot(d) == before, "a refused command changed what was there"

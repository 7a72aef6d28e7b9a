"""Bad input is refused before training: exit code 2, one line naming the problem and the fix, no traceback, and
nothing on disk changed (no log or checkpoint folder, every existing file as it was).

Most cases run in-process through titan_npu.cli.main (fast); a handful run `python train.py` in a real process to
show the exit code and the missing traceback, and that --debug brings the traceback back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from titan_npu.cli import main as cli_main

from .conftest import run_train, snapshot, tiny_args, torchrun


@dataclass
class Case:
    id: str
    args: list[str]  # overrides on top of the tiny run; {d} = the case's folder
    error: str  # the error type the line starts with
    message: str  # a regex the rest of the line matches: the problem and the fix
    setup: Callable[[Path], None] | None = None
    env: dict[str, str] = field(default_factory=dict)


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
    Case("unknown-section", ["--config", "{d}/c.toml"], "ConfigError", r"unknown section 'trainig' \(did you mean",
         _write("c.toml", "[trainig]\nbatch_size = 2\n")),
    Case("key-in-wrong-section", ["--training.lr", "1e-3"], "ConfigError", r"unknown key 'training.lr'.*optimizer"),
    Case("wrong-type", ["--training.batch_size", "two"], "ConfigError", r"training.batch_size = 'two' is not an int"),
    Case("negative-lr", ["--optimizer.lr", "-1e-3"], "ConfigError", r"optimizer.lr = -0.001 must be > 0 \(a typical"),
    Case("zero-batch", ["--training.batch_size", "0"], "ConfigError", r"training.batch_size = 0 must be >= 1"),
    Case("bad-betas", ["--optimizer.betas", "[0.9, 1.5]"], "ConfigError", r"optimizer.betas .* two values in \[0, 1\)"),
    Case("unknown-dtype", ["--training.dtype", "fp8"], "ConfigError", r"training.dtype = 'fp8' is not a known dtype"),
    Case("unknown-optimizer", ["--optimizer.name", "Lion"], "ConfigError", r"optimizer.name = 'Lion' .*use AdamW"),
    Case("negative-resume", ["--checkpoint.resume", "-3"], "ConfigError", r"checkpoint.resume = '-3' must be auto"),
    Case("config-not-found", ["--config", "{d}/nope.toml"], "ConfigError", r"nope.toml' not found \(check the path"),
    Case("config-extension", ["--config", "{d}/c.json"], "ConfigError", r"unsupported extension '.json' \(use .toml",
         _write("c.json", "{}")),
    Case("invalid-toml", ["--config", "{d}/c.toml"], "ConfigError", r"c.toml: invalid TOML: .*line 2",
         _write("c.toml", "[training]\nbatch_size = = 2\n")),
    Case("unknown-model", ["--model.name", "gpt5"], "ConfigError", r"model.name = 'gpt5' is not a known model \(use"),
    Case("unknown-flavor", ["--model.flavor", "3B"], "ConfigError", r"model.flavor='3B' is not a llama3 flavor"),
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
]

_TRAINED: list[Path] = []  # the step-1 checkpoint of one real tiny run, made once for the checkpoint cases


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained")
    assert cli_main(["train", *tiny_args(run, training__max_steps=1, checkpoint__async_save=False)]) == 0
    _TRAINED[:] = [run / "ckpt" / "step-1"]
    yield
    _TRAINED.clear()


@pytest.fixture
def held_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def distributed_env_cleared(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TITAN_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith("TITAN_FAULT_")]:
        monkeypatch.delenv(name)


def test_the_table_covers_at_least_thirty_bad_inputs_of_every_kind():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line_before_anything_is_written(
        case, tmp_path, monkeypatch, capsys, trained_checkpoint, held_port, distributed_env_cleared):
    d = tmp_path / "case"
    d.mkdir()
    if case.setup is not None:
        case.setup(d)
    if (d / "site").is_dir():
        monkeypatch.syspath_prepend(str(d / "site"))
    for key, value in case.env.items():
        monkeypatch.setenv(key, value.format(port=held_port))
    before = snapshot(d)
    capsys.readouterr()

    rc = cli_main(["train", *tiny_args(d), *[a.replace("{d}", str(d)) for a in case.args]])

    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
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

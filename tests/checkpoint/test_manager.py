"""CheckpointManager on one process: exact resume, async snapshots, rotation, crash safety, refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from titan_npu.checkpoint import storage
from titan_npu.errors import CheckpointError
from titan_npu.models.llama import Transformer

from .conftest import TINY, job_config, model_manager, random_model, tokens_for, train_steps

ARGS = TINY["llama3-gqa"]


def _steps(tmp_path) -> list[int]:
    return [ref.step for ref in storage.list_checkpoints(tmp_path / "ckpt")]


def test_resume_continues_with_bitwise_equal_losses(tmp_path):
    tokens = tokens_for(ARGS, seq_len=17)
    model = random_model(ARGS, seed=0)
    manager, opt, sched, state = model_manager(job_config(tmp_path), model, ARGS)
    train_steps(model, opt, sched, state, tokens, 3)
    manager.save(3)
    uninterrupted = train_steps(model, opt, sched, state, tokens, 3)

    fresh = random_model(ARGS, seed=1)  # different weights: everything must come from the checkpoint
    manager2, opt2, sched2, state2 = model_manager(job_config(tmp_path, resume="3", overwrite=True), fresh, ARGS)
    assert manager2.load() and (state2.step, state2.tokens_seen) == (3, 3 * tokens.numel())
    resumed = train_steps(fresh, opt2, sched2, state2, tokens, 3)
    assert resumed == uninterrupted
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_async_save_captures_the_state_of_its_step_not_later_updates(tmp_path):
    tokens = tokens_for(ARGS, seq_len=17)
    model = random_model(ARGS, seed=2)
    manager, opt, sched, state = model_manager(job_config(tmp_path), model, ARGS)
    train_steps(model, opt, sched, state, tokens, 1)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(1, sync=False)
    train_steps(model, opt, sched, state, tokens, 2)  # mutates the parameters while the save may still write
    manager.wait()
    assert _steps(tmp_path) == [1]

    restored = Transformer(ARGS)
    manager2, *_ = model_manager(job_config(tmp_path), restored, ARGS)
    manager2.load()
    for key, value in at_save.items():
        assert torch.equal(restored.state_dict()[key], value), key


def test_keep_last_n_keeps_the_newest_and_the_last_step_is_always_saved(tmp_path):
    tokens = tokens_for(ARGS, seq_len=9)
    model = random_model(ARGS, seed=3)
    cfg = job_config(tmp_path, save_interval=2, keep_last_n=2, async_save=True)
    manager, opt, sched, state = model_manager(cfg, model, ARGS)
    for step in range(1, 8):
        train_steps(model, opt, sched, state, tokens, 1)
        manager.maybe_save(step, last_step=step == 7)
    manager.close()
    assert _steps(tmp_path) == [6, 7]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-6", "step-7"]


def test_saving_a_step_twice_writes_it_once(tmp_path):
    model = random_model(ARGS, seed=4)
    manager, _, _, state = model_manager(job_config(tmp_path), model, ARGS)
    manager.save(5)
    first = (tmp_path / "ckpt" / "step-5" / storage.INFO_FILE).read_text()
    manager.save(5, sync=True)  # e.g. SIGTERM right after the final checkpoint
    assert (tmp_path / "ckpt" / "step-5" / storage.INFO_FILE).read_text() == first


def test_resume_auto_in_an_empty_directory_starts_fresh(tmp_path):
    model = random_model(ARGS, seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager, _, _, state = model_manager(job_config(tmp_path), model, ARGS)
    assert manager.load() is False and state.step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resume_never_refuses_a_directory_holding_checkpoints_unless_overwrite(tmp_path):
    model = random_model(ARGS, seed=6)
    manager, *_ = model_manager(job_config(tmp_path), model, ARGS)
    manager.save(10)
    manager.save(20)
    never, *_ = model_manager(job_config(tmp_path, resume="never"), random_model(ARGS, seed=7), ARGS)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(latest step 20\).*checkpoint.overwrite"):
        never.load()

    replacing, _, _, state = model_manager(job_config(tmp_path, resume="never", overwrite=True),
                                           random_model(ARGS, seed=7), ARGS)
    assert replacing.load() is False
    assert _steps(tmp_path) == [10, 20]  # nothing is deleted before this run has a checkpoint of its own
    replacing.save(5)
    assert _steps(tmp_path) == [5]


def test_resuming_an_older_step_refuses_to_overwrite_later_ones_unless_told(tmp_path):
    model = random_model(ARGS, seed=8)
    manager, *_ = model_manager(job_config(tmp_path, keep_last_n=5), model, ARGS)
    for step in (10, 20, 30):
        manager.save(step)
    older, *_ = model_manager(job_config(tmp_path, resume="10"), random_model(ARGS, seed=9), ARGS)
    with pytest.raises(CheckpointError, match=r"picks step 10 but .* later checkpoints \(steps 20, 30\)"):
        older.load()
    told, _, _, state = model_manager(job_config(tmp_path, resume="10", overwrite=True, keep_last_n=5),
                                      random_model(ARGS, seed=9), ARGS)
    assert told.load() and state.step == 10
    told.save(15)
    assert _steps(tmp_path) == [10, 15]


def test_resume_by_path_loads_that_checkpoint(tmp_path):
    model = random_model(ARGS, seed=10)
    manager, *_ = model_manager(job_config(tmp_path, keep_last_n=5), model, ARGS)
    manager.save(4)
    other = tmp_path / "elsewhere"
    restored = random_model(ARGS, seed=11)
    by_path, _, _, state = model_manager(job_config(other, resume=str(tmp_path / "ckpt" / "step-4")), restored, ARGS)
    assert by_path.load() and state.step == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in restored.state_dict().items())


def test_a_checkpoint_of_another_model_size_names_keys_shapes_and_cause(tmp_path):
    manager, *_ = model_manager(job_config(tmp_path), random_model(ARGS, seed=12), ARGS)
    manager.save(1)
    fields = {k: getattr(ARGS, k) for k in ARGS.__dataclass_fields__}
    bigger = type(ARGS)(**{**fields, "dim": 128, "n_layers": 3})
    loader, *_ = model_manager(job_config(tmp_path), Transformer(bigger), bigger)
    with pytest.raises(CheckpointError) as err:
        loader.load()
    message = str(err.value)
    assert "does not fit the model" in message and "missing key(s) (e.g. layers.2." in message
    assert "checkpoint (160, 64) vs model (160, 128)" in message and "another model size" in message


def test_a_checkpoint_of_another_optimizer_says_so(tmp_path):
    manager, *_ = model_manager(job_config(tmp_path), random_model(ARGS, seed=13), ARGS)
    manager.save(1)
    model = random_model(ARGS, seed=13)
    from types import SimpleNamespace

    from titan_npu.checkpoint.manager import CheckpointManager

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = CheckpointManager(job_config(tmp_path), [model], sgd, None, None, SimpleNamespace(step=0, tokens_seen=0))
    with pytest.raises(CheckpointError, match=r"optimizer state in .* does not fit .*optimizer.name changed"):
        loader.load()


_CRASHING_RUN = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch.distributed.checkpoint.filesystem as fs
    from checkpoint.conftest import TINY, job_config, model_manager, random_model, tokens_for, train_steps
    from pathlib import Path

    args = TINY["llama3-gqa"]
    model = random_model(args, seed=0)
    manager, opt, sched, state = model_manager(job_config(Path({tmp!r}), async_save=True), model, args)
    tokens = tokens_for(args, seq_len=9)
    train_steps(model, opt, sched, state, tokens, 2)
    manager.save(2, sync=True)
    # Test instrumentation: make the background writer slow, so the kill lands while it writes.
    write = fs.FileSystemWriter.write_data
    def slow_write(self, plan, planner):
        time.sleep(30)
        return write(self, plan, planner)
    fs.FileSystemWriter.write_data = slow_write
    train_steps(model, opt, sched, state, tokens, 2)
    manager.save(4, sync=False)
    print("staged", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "run.py"
    script.write_text(_CRASHING_RUN.format(tests=tests_dir, tmp=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "staged" in proc.stdout
    assert (tmp_path / "ckpt" / "step-4.tmp").is_dir()  # the interrupted save, never published
    assert _steps(tmp_path) == [2]

    restored = random_model(ARGS, seed=1)
    manager, _, _, state = model_manager(job_config(tmp_path), restored, ARGS)
    assert manager.load() and state.step == 2
    assert not (tmp_path / "ckpt" / "step-4.tmp").exists()


class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_extra_states_round_trip_and_a_checkpoint_without_one_still_loads(tmp_path):
    from types import SimpleNamespace

    from titan_npu.checkpoint.manager import CheckpointManager

    def manager_with(extra, root):
        model = random_model(ARGS, seed=14)
        optimizer = torch.optim.AdamW(model.parameters())
        return CheckpointManager(job_config(root), [model], optimizer, None, None,
                                 SimpleNamespace(step=0, tokens_seen=0), model_args=ARGS, extra=extra)

    counter = _Counter()
    counter.count = 7
    manager_with({"counter": counter}, tmp_path / "with").save(1)
    restored = _Counter()
    assert manager_with({"counter": restored}, tmp_path / "with").load() and restored.count == 7

    manager_with(None, tmp_path / "without").save(1)
    fresh = _Counter()
    assert manager_with({"counter": fresh}, tmp_path / "without").load() and fresh.count == 0

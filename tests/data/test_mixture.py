"""A weighted mixture of sources (data/mixture.py): exact proportions after every step, deterministic, each source
on its own reshuffled epochs, resumable bit for bit, the same global windows on another dp world size.

Each source here is a tokens JSONL whose ids lie in a range of its own, so a window tells which source it came from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from titan_npu.config.loader import load_config
from titan_npu.data.loader import TokenLoader, build_dataloader
from titan_npu.data.mixture import Blend, MixtureLoader
from titan_npu.data.tokenizer import build_tokenizer
from titan_npu.errors import DataError

TOKENIZER = build_tokenizer("byte")
RANGES = {"web": 10, "code": 70, "math": 130}  # a source's ids: [lo, lo + 50)


def write_source(folder: Path, name: str, docs: int, seed: int = 0) -> Path:
    """A tokens JSONL of `docs` documents with ids in the source's own range."""
    lo = RANGES[name]
    rng = np.random.default_rng([seed, lo])
    path = folder / f"{name}.jsonl"
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"tokens": rng.integers(lo, lo + 50, size=int(rng.integers(5, 30))).tolist()}) + "\n")
    return path


def source_of(row: np.ndarray) -> str:
    ids = row[(row >= 10) & (row < 180)]
    lo = int(np.median(ids)) // 60 * 60 + 10
    return {v: k for k, v in RANGES.items()}[lo]


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    return {"web": write_source(tmp_path, "web", 300), "code": write_source(tmp_path, "code", 120),
            "math": write_source(tmp_path, "math", 20)}


def mixture(sources: dict[str, Path], weights=(0.6, 0.3, 0.1), dp_rank: int = 0, dp: int = 1, batch_size: int = 4,
            *extra: str) -> MixtureLoader:
    spec = " ".join(f"{w} {sources[n]}" for w, n in zip(weights, ("web", "code", "math")) if w is not None)
    cfg = load_config(None, ["--data_path", spec, "--training.seq_len", "16", "--training.batch_size",
                             str(batch_size), "--data.num_workers", "0", *extra], model=False)
    loader = build_dataloader(cfg, TOKENIZER, dp_rank, dp)
    assert isinstance(loader, MixtureLoader)
    return loader


def windows(loader, steps: int) -> list[list[bytes]]:
    return [[row.tobytes() for row in next(loader)[0].numpy()] for _ in range(steps)]


def test_every_prefix_of_200_steps_is_within_one_window_of_the_weights(sources):
    loader = mixture(sources)
    counts = dict.fromkeys(RANGES, 0)
    total = 0
    for _ in range(200):
        for row in next(loader)[0].numpy():
            counts[source_of(row)] += 1
            total += 1
        for name, w in zip(("web", "code", "math"), (0.6, 0.3, 0.1)):
            assert abs(counts[name] - w * total) <= 1, (name, counts, total)
    assert loader.source_tokens() == {name: c * 16 for name, c in counts.items()}


def test_the_blend_holds_any_weights_within_one_window():
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = rng.random(int(rng.integers(2, 9))) ** 3
        w = list(w / w.sum())
        blend = Blend(w)
        for t in range(1, 501):
            blend.take(1)
            assert max(abs(c - x * t) for c, x in zip(blend.counts, w)) <= 1


def test_two_runs_are_identical_and_the_seed_changes_the_order_not_the_proportions(sources):
    a, b = windows(mixture(sources), 30), windows(mixture(sources), 30)
    c_loader = mixture(sources, (0.6, 0.3, 0.1), 0, 1, 4, "--training.seed", "7")
    c = windows(c_loader, 30)
    assert a == b
    assert a != c
    count = lambda ws: sorted(source_of(np.frombuffer(r, np.int64)) for step in ws for r in step)  # noqa: E731
    assert count(a) == count(c)


def test_resume_from_the_state_continues_with_the_same_windows(sources):
    full = mixture(sources)
    first = windows(full, 7)
    state = full.state_dict()
    rest = windows(full, 20)
    resumed = mixture(sources)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # plain values: as a checkpoint holds them
    assert windows(resumed, 20) == rest
    assert first  # (the steps before the state are not replayed)


def test_two_ranks_continue_the_global_sequence_of_one(sources):
    one = mixture(sources, batch_size=2)
    windows(one, 5)
    state = one.state_dict()
    ahead = [w for step in windows(one, 8) for w in step]  # 16 windows
    ranks = [mixture(sources, (0.6, 0.3, 0.1), r, 2, 2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state, allow_reshard=True)
    both = [windows(r, 4) for r in ranks]
    merged = [w for step in range(4) for r in range(2) for w in both[r][step]]
    assert merged == ahead


def test_a_different_dp_size_without_allow_reshard_is_refused(sources):
    one = mixture(sources, batch_size=2)
    with pytest.raises(DataError, match="dp_world_size 1"):
        mixture(sources, (0.6, 0.3, 0.1), 0, 2, 2).load_state_dict(one.state_dict())


def test_a_source_that_runs_out_starts_its_next_epoch_reshuffled_and_says_so_once(sources, caplog):
    loader = mixture(sources)
    n = loader.windows[2].num_windows  # math: the smallest
    caplog.set_level(logging.INFO, logger="titan_npu")
    seen = [w for step in windows(loader, 5 * n + 3) for w in step if source_of(np.frombuffer(w, np.int64))
            == "math"]
    lines = [r.getMessage() for r in caplog.records if "'math' ran out" in r.getMessage()]
    assert lines[0] == f"data: source 'math' ran out after 1 epoch(s) of {n} windows; epoch 2 begins, reshuffled"
    assert len([line for line in lines if "after 1 epoch" in line]) == 1
    assert sorted(seen[:n]) == sorted(seen[n : 2 * n]) and seen[:n] != seen[n : 2 * n]


def test_max_epochs_refuses_to_read_a_source_again(tmp_path, sources):
    cfg = tmp_path / "mix.toml"
    cfg.write_text("".join(f'[[data.sources]]\nname = "{n}"\npath = "{sources[n]}"\nweight = {w}\n'
                           + ("max_epochs = 1\n" if n == "math" else "")
                           for n, w in (("web", 0.6), ("code", 0.3), ("math", 0.1))))
    loader = build_dataloader(load_config(cfg, ["--training.seq_len", "16", "--training.batch_size", "4",
                                                "--data.num_workers", "0"], model=False), TOKENIZER, 0, 1)
    n = loader.windows[2].num_windows
    with pytest.raises(DataError, match=r"^data source 'math' .* has been read 1 time\(s\), its max_epochs = 1; "):
        for _ in range(10 * n):
            next(loader)
    assert loader.blend.counts[2] == n  # every window of its one epoch, and not one more


def test_changed_weights_on_resume_apply_from_there_and_keep_the_counts(sources, caplog):
    old = mixture(sources)
    windows(old, 10)
    state = old.state_dict()
    new = mixture(sources, (0.2, 0.2, 0.6))
    caplog.set_level(logging.INFO, logger="titan_npu")
    new.load_state_dict(state)
    assert [r.getMessage() for r in caplog.records if "mixture changed" in r.getMessage()] == [
        "data: the mixture changed on resume (web=0.6 code=0.3 math=0.1 -> web=0.2 code=0.2 math=0.6); the new "
        "proportions apply from window 40 on, the per-source counts carry over"]
    before = dict(zip(new.names, new.blend.counts))
    assert before == {"web": 24, "code": 12, "math": 4}
    windows(new, 25)  # 100 windows more
    after = dict(zip(new.names, new.blend.counts))
    assert {k: after[k] - before[k] for k in after} == {"web": 20, "code": 20, "math": 60}
    again = mixture(sources, (0.2, 0.2, 0.6))
    caplog.clear()
    again.load_state_dict(new.state_dict())  # the same weights: no line, the new proportions continue
    assert not [r for r in caplog.records if "mixture changed" in r.getMessage()]
    assert again.blend.base == new.blend.base


def test_one_source_and_a_mixture_refuse_each_others_state_in_one_line(sources):
    cfg = load_config(None, ["--data.path", str(sources["web"]), "--training.seq_len", "16",
                             "--data.num_workers", "0"], model=False)
    single = build_dataloader(cfg, TOKENIZER, 0, 1)
    assert isinstance(single, TokenLoader)
    with pytest.raises(DataError, match="^the checkpoint's data position is for one source"):
        mixture(sources).load_state_dict(single.state_dict())
    with pytest.raises(DataError, match="^the checkpoint's data position is a mixture of 3 sources"):
        single.load_state_dict(mixture(sources).state_dict())


def test_data_path_alone_and_one_source_give_the_windows_of_the_single_loader(sources):
    base = ["--training.seq_len", "16", "--data.num_workers", "0"]
    plain = build_dataloader(load_config(None, ["--data.path", str(sources["code"]), *base], model=False),
                             TOKENIZER, 0, 1)
    megatron = build_dataloader(load_config(None, ["--data_path", str(sources["code"]), *base], model=False),
                                TOKENIZER, 0, 1)
    assert isinstance(megatron, TokenLoader)
    assert windows(plain, 40) == windows(megatron, 40)


def test_prefetch_workers_hand_out_the_same_windows_and_state(sources):
    plain = mixture(sources)
    workers = mixture(sources, (0.6, 0.3, 0.1), 0, 1, 4, "--data.num_workers", "2")
    assert windows(workers, 12) == windows(plain, 12)
    assert workers.state_dict() == plain.state_dict()
    workers.close()


def test_place_splits_a_step_among_other_ranks_from_a_saved_position(sources):
    """Fault tolerance re-splits each step among the replica groups taking part (loader.place)."""
    one = mixture(sources, batch_size=2)
    windows(one, 3)
    position = one.position
    ahead = [w for step in windows(one, 2) for w in step]
    halves = []
    for rank in range(2):
        loader = mixture(sources, batch_size=2)
        loader.place(rank, 2, position)
        halves.append(windows(loader, 1)[0])
    assert halves[0] + halves[1] == ahead


def test_a_source_added_or_dropped_on_resume_starts_at_zero_or_keeps_its_count(sources, caplog):
    two = mixture(sources, (0.5, 0.5, None))
    windows(two, 5)
    three = mixture(sources, (0.4, 0.4, 0.2))
    caplog.set_level(logging.INFO, logger="titan_npu")
    three.load_state_dict(two.state_dict())
    assert dict(zip(three.names, three.blend.counts)) == {"web": 10, "code": 10, "math": 0}
    assert any("mixture changed on resume (web=0.5 code=0.5 -> web=0.4 code=0.4 math=0.2)" in r.getMessage()
               for r in caplog.records)
    windows(three, 5)
    assert dict(zip(three.names, three.blend.counts)) == {"web": 18, "code": 18, "math": 4}
    back = mixture(sources, (0.5, 0.5, None))
    back.load_state_dict(three.state_dict())
    assert back.source_tokens() == {"web": 18 * 16, "code": 18 * 16, "math": 4 * 16}  # math's count kept


def test_max_epochs_holds_for_a_single_source_too(tmp_path, sources):
    cfg = tmp_path / "one.toml"
    cfg.write_text(f'[[data.sources]]\nname = "math"\npath = "{sources["math"]}"\nmax_epochs = 1\n')
    loader = build_dataloader(load_config(cfg, ["--training.seq_len", "16", "--training.batch_size", "4",
                                                "--data.num_workers", "0"], model=False), TOKENIZER, 0, 1)
    assert isinstance(loader, TokenLoader)
    with pytest.raises(DataError, match=r"^data source 'math' .* has been read 1 time\(s\), its max_epochs = 1"):
        for _ in range(100):
            next(loader)
    assert loader.epoch == 1


def test_megatron_lists_in_yaml_read_as_the_one_line_form(tmp_path, sources):
    yaml = tmp_path / "mix.yaml"
    yaml.write_text(f"data_path: [0.6, {sources['web']}, 0.3, {sources['code']}, 0.1, {sources['math']}]\n"
                    "training: {seq_len: 16, batch_size: 4}\ndata: {num_workers: 0}\n")
    assert windows(build_dataloader(load_config(yaml, model=False), TOKENIZER, 0, 1), 5) == windows(
        mixture(sources), 5)


def test_document_masking_marks_each_rows_own_documents(sources):
    masked = mixture(sources, (0.6, 0.3, 0.1), 0, 1, 4, "--data.document_mask", "true")
    plain = mixture(sources)
    for _ in range(5):
        inputs, _, documents = next(masked)
        assert inputs.tolist() == next(plain)[0].tolist()
        for row, ids in zip(inputs.tolist(), documents.ids.tolist()):
            begins = [p for p in range(1, len(row)) if ids[p] != ids[p - 1]]
            assert begins == [p for p in range(1, len(row)) if row[p - 1] == TOKENIZER.eos_id]

"""The loader: packing, exact resume (any num_workers), disjoint ranks, splits, formats and each refusal."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from data_helpers import make_docs, write_jsonl

from titan_npu.data import build_dataloader, build_tokenizer
from titan_npu.data.datasets import read_index
from titan_npu.data.loader import split_documents
from titan_npu.data.prepare import prepare
from titan_npu.errors import DataError

BYTE = build_tokenizer("byte")


def _stream(docs: list[str]) -> np.ndarray:
    return np.concatenate([BYTE.encode(d, bos=True, eos=True) for d in docs])


def _rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, ...]]:
    """Each row as its full window: inputs plus the last label."""
    inputs, labels = batch
    return [tuple(torch.cat([row, lab[-1:]]).tolist()) for row, lab in zip(inputs, labels)]


@pytest.fixture
def shards(corpus_txt, tmp_path):
    prepare([str(corpus_txt)], tmp_path / "shards", shard_size=250)
    return tmp_path / "shards"


def test_batches_are_long_tensors_with_labels_shifted_by_one(small_cfg):
    loader = build_dataloader(small_cfg("", batch_size=3, seq_len=32), BYTE, 0, 1)
    inputs, labels = next(loader)
    assert inputs.shape == labels.shape == (3, 32) and inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_shards_to_batches_reproduce_the_token_stream_exactly(shards, corpus_txt, small_cfg):
    docs = [d.strip() for d in corpus_txt.read_text().split("\n\n")]
    stream, seq_len = _stream(docs), 16
    n_windows = (len(stream) - 1) // seq_len
    expected = Counter(tuple(stream[w * seq_len : w * seq_len + seq_len + 1].tolist()) for w in range(n_windows))
    loader = build_dataloader(small_cfg(str(shards), batch_size=4, seq_len=seq_len), BYTE, 0, 1)
    seen = Counter(row for _ in range(n_windows // 4) for row in _rows(next(loader)))
    # One epoch is every window once, less the < batch_size left over when the epoch does not divide.
    assert not seen - expected
    assert sum(seen.values()) == n_windows // 4 * 4 and sum((expected - seen).values()) == n_windows % 4


@pytest.mark.parametrize("workers_before, workers_after", [(0, 0), (2, 2), (2, 0)])
def test_resume_after_k_batches_yields_exactly_the_uninterrupted_batches(shards, small_cfg, workers_before,
                                                                         workers_after):
    cfg_before = small_cfg(str(shards), batch_size=4, seq_len=64, num_workers=workers_before)
    cfg_after = small_cfg(str(shards), batch_size=4, seq_len=64, num_workers=workers_after)
    reference = build_dataloader(small_cfg(str(shards), batch_size=4, seq_len=64), BYTE, 0, 1)
    expected = [next(reference) for _ in range(22)]
    assert reference.state_dict()["epoch"] == 1  # the 22 batches cross an epoch boundary
    first = build_dataloader(cfg_before, BYTE, 0, 1)
    for k in range(10):
        assert all(torch.equal(a, b) for a, b in zip(next(first), expected[k]))
    state = first.state_dict()
    first.close()
    assert all(type(v) in (int, str) for v in state.values())
    resumed = build_dataloader(cfg_after, BYTE, 0, 1)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for k in range(10, 22):
        assert all(torch.equal(a, b) for a, b in zip(next(resumed), expected[k]))
    resumed.close()


@pytest.fixture
def numbered(tmp_path):
    """A tokens JSONL whose stream is 0, 1, 2, ... 1199, so a window's first token tells which window it is."""
    bounds = [0, 37, 100, 101, 350, 600, 777, 1000, 1200]
    records = [{"tokens": list(range(a, b)), "length": b - a} for a, b in zip(bounds, bounds[1:])]
    return write_jsonl(tmp_path / "numbered.jsonl", records)


def _window_ids(batch: tuple[torch.Tensor, torch.Tensor], seq_len: int) -> list[int]:
    return (batch[0][:, 0] // seq_len).tolist()


def test_ranks_see_disjoint_windows_that_cover_the_epoch(numbered, small_cfg):
    cfg = small_cfg(str(numbered), batch_size=3, seq_len=10)
    per_rank = []
    for rank in range(2):
        loader = build_dataloader(cfg, None, rank, 2)
        steps = loader.windows.num_windows // 6
        per_rank.append([w for _ in range(steps) for w in _window_ids(next(loader), 10)])
    assert loader.windows.num_windows == 119 and steps == 19
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(set(per_rank[0]) | set(per_rank[1])) == 19 * 6


@pytest.mark.parametrize("workers", [0, 1])
def test_placing_a_loader_among_fewer_replicas_reads_on_from_the_same_window_and_a_step_can_be_read_again(
        numbered, small_cfg, workers):
    """Fault tolerance: each step is split among the replica groups that take part, from one global position."""
    cfg = small_cfg(str(numbered), batch_size=2, seq_len=10, num_workers=workers)
    whole = build_dataloader(cfg, None, 0, 1)
    stream = [w for _ in range(6) for w in _window_ids(next(whole), 10)]  # the windows in order, 2 per batch
    loader = build_dataloader(cfg, None, 0, 2)
    loader.place(1, 2)  # step 1 with two groups: this one reads the second slice
    assert _window_ids(next(loader), 10) == stream[2:4]
    loader.place(0, 1)  # the other group left: step 2 alone, from the next window on
    before = loader.position
    assert _window_ids(next(loader), 10) == stream[4:6]
    loader.place(0, 1, before)  # step 2 did not commit: it is read again
    assert _window_ids(next(loader), 10) == stream[4:6]
    loader.place(1, 2)  # the group is back: step 3 split in two again
    assert _window_ids(next(loader), 10) == stream[8:10]
    with pytest.raises(DataError, match="dp_rank=2 is outside dp_world_size=2"):
        loader.place(2, 2)
    loader.close()


def test_each_epoch_is_a_new_deterministic_shuffle(numbered, small_cfg):
    def epoch_orders(seed: int) -> tuple[list[int], list[int]]:
        cfg = small_cfg(str(numbered), batch_size=4, seq_len=10)
        cfg.training.seed = seed
        loader = build_dataloader(cfg, None, 0, 1)
        ids = [w for _ in range(2 * 29) for w in _window_ids(next(loader), 10)]
        return ids[: 29 * 4], ids[29 * 4 :]

    epoch0, epoch1 = epoch_orders(42)
    assert epoch0 != epoch1 and len(set(epoch0)) == len(set(epoch1)) == 116
    assert epoch_orders(42) == (epoch0, epoch1)
    assert epoch_orders(7)[0] != epoch0


def test_validation_split_holds_out_a_fixed_fraction_of_documents():
    val = split_documents(1000, 0.1, "validation")
    train = split_documents(1000, 0.1, "train")
    assert 95 <= len(val) <= 105 and len(val) + len(train) == 1000 and not set(val) & set(train)
    assert np.array_equal(val, split_documents(1000, 0.1, "validation"))
    assert split_documents(1000, 0.0, "validation").size == 0


def test_validation_loader_reads_only_held_out_documents(tmp_path, small_cfg):
    docs = make_docs(200)
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    cfg = small_cfg(str(path), batch_size=2, seq_len=16, val_fraction=0.2)
    val = build_dataloader(cfg, BYTE, 0, 1, split="validation")
    train = build_dataloader(cfg, BYTE, 0, 1, split="train")
    held_out = split_documents(200, 0.2, "validation")
    expected = _stream([docs[i] for i in held_out])
    got = np.concatenate([next(val)[0].reshape(-1).numpy() for _ in range(5)])
    assert np.array_equal(got, expected[: len(got)])  # validation is the held-out stream, in order
    assert val.windows.num_tokens + train.windows.num_tokens == len(_stream(docs))


def test_validation_data_path_overrides_the_split(tmp_path, small_cfg, corpus_txt):
    other = tmp_path / "val.txt"
    other.write_text("\n\n".join(make_docs(30, seed=5)))
    cfg = small_cfg(str(corpus_txt), batch_size=2, seq_len=16)
    with pytest.raises(DataError, match="no validation data: set data.val_fraction > 0 or validation.data"):
        build_dataloader(cfg, BYTE, 0, 1, split="validation")
    cfg.validation.data = str(other)
    loader = build_dataloader(cfg, BYTE, 0, 1, split="validation")
    assert loader.windows.num_tokens == len(_stream(make_docs(30, seed=5)))


def test_data_smaller_than_one_batch_names_both_numbers(tmp_path, small_cfg):
    (tmp_path / "tiny.txt").write_text("just a few bytes of text here\n")
    message = r"tiny.txt \(train\) has 31 tokens = 1 window\(s\) of seq_len\+1=17, fewer than one global batch of 4"
    with pytest.raises(DataError, match=message + r" \(batch_size 2 x dp 2\)"):
        build_dataloader(small_cfg(str(tmp_path / "tiny.txt"), batch_size=2, seq_len=16), BYTE, 0, 2)


def test_resume_with_another_dp_world_size_is_refused_unless_resharding(numbered, small_cfg):
    cfg = small_cfg(str(numbered), batch_size=2, seq_len=10)
    one = build_dataloader(cfg, None, 0, 1)
    for _ in range(5):
        next(one)
    state = one.state_dict()
    following = _window_ids(next(one), 10) + _window_ids(next(one), 10)  # the next 4 windows of the global order
    two = [build_dataloader(cfg, None, r, 2) for r in range(2)]
    with pytest.raises(DataError, match="saved with dp_world_size 1, the run has 2"):
        two[0].load_state_dict(state)
    for loader in two:
        loader.load_state_dict(state, allow_reshard=True)
    assert _window_ids(next(two[0]), 10) + _window_ids(next(two[1]), 10) == following


def test_resume_with_another_seq_len_or_seed_is_refused(shards, small_cfg):
    state = build_dataloader(small_cfg(str(shards), seq_len=16), BYTE, 0, 1).state_dict()
    with pytest.raises(DataError, match="seq_len 16, this data has .* of seq_len 8"):
        build_dataloader(small_cfg(str(shards), seq_len=8), BYTE, 0, 1).load_state_dict(state)
    cfg = small_cfg(str(shards), seq_len=16)
    cfg.training.seed = 1
    with pytest.raises(DataError, match="used seed 42, the run uses 1"):
        build_dataloader(cfg, BYTE, 0, 1).load_state_dict(state)


def test_guides_tokens_jsonl_loads_with_eos_between_documents(tmp_path, small_cfg):
    docs = [list(range(1, 30)), list(range(40, 90)), [5, 6, 257], list(range(100, 140))]
    path = write_jsonl(tmp_path / "tokens.jsonl", [{"tokens": d, "length": len(d)} for d in docs])
    loader = build_dataloader(small_cfg(str(path), batch_size=1, seq_len=8, val_fraction=0.0), BYTE, 0, 1)
    expected = np.array(docs[0] + [257] + docs[1] + [257] + docs[2] + docs[3] + [257])
    assert loader.windows.num_tokens == len(expected)
    for w in range(loader.windows.num_windows):
        assert np.array_equal(loader.windows.window(w), expected[w * 8 : w * 8 + 9])
    assert (tmp_path / "tokens.jsonl.titan-index.npz").is_file()  # the offset index is built once


def test_a_refused_tokens_jsonl_leaves_no_index_cache_beside_it(tmp_path, small_cfg):
    path = write_jsonl(tmp_path / "tokens.jsonl", [{"tokens": [1, 2, 900]}] * 20)
    with pytest.raises(DataError, match="holds token id 900 but model.vocab_size is 512"):
        build_dataloader(small_cfg(str(path), seq_len=4), BYTE, 0, 1, model_vocab_size=512)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.jsonl"]


def test_an_index_cache_write_that_fails_midway_leaves_no_file_beside_the_data(tmp_path, small_cfg, monkeypatch):
    path = write_jsonl(tmp_path / "tokens.jsonl", [{"tokens": [1, 2, 3]}] * 20)

    def savez_then_fail(file, **arrays):
        file.write(b"PK\x03\x04")
        raise MemoryError

    monkeypatch.setattr(np, "savez", savez_then_fail)
    with pytest.raises(MemoryError):
        build_dataloader(small_cfg(str(path), seq_len=4), BYTE, 0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.jsonl"]


def test_malformed_tokens_jsonl_names_file_and_line(tmp_path, small_cfg):
    path = tmp_path / "tokens.jsonl"
    path.write_text('{"tokens": [1, 2, 3], "length": 3}\n{"tokens": [1, 2], "length": 5}\n')
    with pytest.raises(DataError, match=r"tokens.jsonl:2: 'length' is 5 but 'tokens' has 2"):
        build_dataloader(small_cfg(str(path)), BYTE, 0, 1)


def test_token_ids_beyond_the_model_vocab_name_the_file_and_both_numbers(shards, tmp_path, small_cfg):
    with pytest.raises(DataError, match=r"shards/shard_00000.bin holds token id 257 but model.vocab_size is 200"):
        build_dataloader(small_cfg(str(shards)), BYTE, 0, 1, model_vocab_size=200)
    path = write_jsonl(tmp_path / "t.jsonl", [{"tokens": [1, 2]}, {"tokens": list(range(1, 40)) + [999]}])
    with pytest.raises(DataError, match=r"t.jsonl:2 holds token id 999 but model.vocab_size is 512"):
        build_dataloader(small_cfg(str(path), batch_size=1, seq_len=8), None, 0, 1, model_vocab_size=512)


def test_shards_of_another_tokenizer_are_refused(shards, small_cfg, tmp_path):
    from titan_npu.data.sources import builtin_corpus_path
    from titan_npu.data.train_tokenizer import train_bpe

    train_bpe([str(builtin_corpus_path())], 300, tmp_path / "bpe")
    with pytest.raises(DataError, match=r"was tokenised with a different tokenizer .* use the same tokenizer "
                                        r"\(prepare-data was given byte: --data.tokenizer byte\) or re-run"):
        build_dataloader(small_cfg(str(shards)), build_tokenizer(str(tmp_path / "bpe")), 0, 1)


def test_truncated_shard_is_refused(shards, small_cfg):
    shard = shards / read_index(shards)["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"shard_00001.bin is \d+ bytes but index.json says \d+ bytes \(truncated"):
        build_dataloader(small_cfg(str(shards)), BYTE, 0, 1)


def test_raw_txt_and_jsonl_are_tokenised_on_the_fly(tmp_path, small_cfg):
    docs = make_docs(30)
    (tmp_path / "raw.txt").write_text("\n\n".join(docs))
    path = write_jsonl(tmp_path / "raw.jsonl", [{"body": d} for d in docs])
    txt = build_dataloader(small_cfg(str(tmp_path / "raw.txt")), BYTE, 0, 1)
    jsonl = build_dataloader(small_cfg(str(path), text_field="body"), BYTE, 0, 1)
    assert txt.windows.num_tokens == jsonl.windows.num_tokens == len(_stream(docs))
    assert all(torch.equal(a, b) for a, b in zip(next(txt), next(jsonl)))


def test_empty_data_path_is_the_builtin_corpus(small_cfg):
    loader = build_dataloader(small_cfg(""), BYTE, 0, 1)
    assert loader.windows.num_tokens > 400_000
    assert "built-in corpus" in loader.windows.dataset.description


def test_document_starts_of_a_batch_are_where_bos_sits(shards, small_cfg):
    loader = build_dataloader(small_cfg(str(shards), batch_size=4, seq_len=64), BYTE, 0, 1)
    starts = loader.doc_starts()
    inputs, labels = next(loader)
    for row, offsets in zip(torch.cat([inputs, labels[:, -1:]], dim=1), starts):
        assert offsets.tolist() == torch.nonzero(row == BYTE.bos_id).flatten().tolist()


def test_pinned_memory_is_asked_for_accelerators_only_when_one_is_present(small_cfg):
    present = torch.accelerator.is_available()
    cpu = build_dataloader(small_cfg(""), BYTE, 0, 1, device_type="cpu")
    cuda = build_dataloader(small_cfg(""), BYTE, 0, 1, device_type="cuda")
    assert cpu.pin_memory is False and cuda.pin_memory is present
    inputs, _ = next(cuda)
    assert inputs.is_pinned() is present


@pytest.mark.parametrize("reset", [False, True], ids=["mask", "reset_positions"])
def test_document_masking_batches_carry_documents_that_start_after_each_eos(shards, small_cfg, reset):
    cfg = small_cfg(str(shards), batch_size=4, seq_len=64, document_mask=True, reset_position_ids=reset)
    loader = build_dataloader(cfg, BYTE, 0, 1)
    for _ in range(3):
        inputs, labels, documents = next(loader)
        # A new document begins right after every EOS of the inputs, and nowhere else.
        after_eos = torch.cat([torch.zeros(4, 1, dtype=torch.bool), inputs[:, :-1] == BYTE.eos_id], dim=1)
        assert torch.equal(documents.ids.diff(dim=1) != 0, after_eos[:, 1:])
        assert documents.ids.dtype == torch.int32 and documents.ids.shape == inputs.shape
        assert documents.cu_seqlens[-1] == inputs.numel() and all(type(n) is int for n in documents.cu_seqlens)
        if reset:
            assert documents.positions[after_eos].eq(0).all() and documents.positions[:, 0].eq(0).all()
        else:
            assert documents.positions is None


def test_document_masking_batches_resume_exactly_with_their_documents_through_workers(shards, small_cfg):
    cfg = small_cfg(str(shards), batch_size=2, seq_len=64, document_mask=True, reset_position_ids=True)
    reference = build_dataloader(cfg, BYTE, 0, 1)
    expected = [next(reference) for _ in range(6)]
    first = build_dataloader(cfg, BYTE, 0, 1)
    for _ in range(3):
        next(first)
    resumed = build_dataloader(small_cfg(str(shards), batch_size=2, seq_len=64, num_workers=1, document_mask=True,
                                         reset_position_ids=True), BYTE, 0, 1)
    resumed.load_state_dict(first.state_dict())
    for want in expected[3:]:
        inputs, labels, documents = next(resumed)
        assert torch.equal(inputs, want[0]) and torch.equal(labels, want[1])
        assert torch.equal(documents.ids, want[2].ids) and torch.equal(documents.positions, want[2].positions)
        assert documents.cu_seqlens == want[2].cu_seqlens
    resumed.close()

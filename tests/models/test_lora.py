"""LoRA in a training run: only the adapters get gradients and optimizer state, a checkpoint holds them and resumes
exactly, and every mistake in [lora] or in its export is refused in one line (exit 2) with nothing written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_run import refusal_line, snapshot, tiny_args, train_tiny  # noqa: E402

from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries  # noqa: E402
from titan_npu.cli import main  # noqa: E402
from titan_npu.config.schema import LORA_DEFAULT_TARGETS, LoraConfig  # noqa: E402
from titan_npu.lora.apply import apply_lora  # noqa: E402
from titan_npu.models.decoder.args import DecoderArgs  # noqa: E402
from titan_npu.models.registry import build_model  # noqa: E402

LORA = {"lora__enable": True, "lora__rank": 4, "lora__alpha": 8}


def _adapters(ckpt: Path) -> dict[str, torch.Tensor]:
    metadata = read_metadata(ckpt)
    keys = [f"model.{k}" for k in tensor_entries(metadata, "model.") if k.endswith((".lora_A", ".lora_B"))]
    return load_tensors(ckpt, metadata, keys)


def test_only_the_adapters_train_and_hold_optimizer_state(tmp_path):
    ckpt = train_tiny(tmp_path, steps=2, **LORA) / "step-2"
    metadata = read_metadata(ckpt)
    moments = {k.rsplit(".", 1)[0] for k in tensor_entries(metadata, "optimizer.state.")}
    model = tensor_entries(metadata, "model.")
    adapters = {k for k in model if k.endswith((".lora_A", ".lora_B"))}
    # 2 layers x 7 projections x (A, B); AdamW's moments for those alone.
    assert len(adapters) == 28 and moments == adapters
    # The frozen weights are the seed's: a run without LoRA draws the same initial weights.
    seed = train_tiny(tmp_path / "plain", steps=1, optimizer__lr=1e-12) / "step-1"
    frozen = [f"model.{k}" for k in model if k not in adapters]
    mine, initial = load_tensors(ckpt, metadata, frozen), load_tensors(seed, read_metadata(seed), frozen)
    assert all(torch.allclose(mine[k], initial[k], rtol=0, atol=1e-9) for k in frozen)


def test_a_lora_run_resumed_from_its_checkpoint_ends_where_an_unbroken_one_does(tmp_path):
    straight = _adapters(train_tiny(tmp_path / "a", steps=4, **LORA) / "step-4")
    train_tiny(tmp_path / "b", steps=2, **LORA)
    resumed = _adapters(train_tiny(tmp_path / "b", steps=4, **LORA) / "step-4")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_resuming_a_lora_checkpoint_with_other_lora_settings_is_refused_in_one_line(tmp_path, capsys):
    train_tiny(tmp_path, steps=1, **LORA)
    before = snapshot(tmp_path)
    for extra in ({**LORA, "lora__rank": 8}, {}):
        line = refusal_line(capsys, ["train", *tiny_args(tmp_path, training__max_steps=2, **extra)])
        assert "was trained rank 4 on" in line and "--merge" in line, line
    assert snapshot(tmp_path) == before


def test_adapters_start_as_the_base_model_and_only_they_require_gradients():
    args = DecoderArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights(seed=1)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        before = model(tokens)
    names = apply_lora(model, LoraConfig(enable=True, rank=4, target_modules=["layers.1.attention.w[qv]", "w2"]),
                       LORA_DEFAULT_TARGETS)
    assert names == ["layers.0.feed_forward.w2", "layers.1.attention.wq", "layers.1.attention.wv",
                     "layers.1.feed_forward.w2"]
    model.init_weights(seed=1)
    with torch.no_grad():
        assert torch.equal(model(tokens), before)  # B = 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{n}.lora_{x}" for n in names for x in "AB"]


@pytest.mark.parametrize("extra, message", [
    ({"lora__rank": 0}, r"lora\.rank"),
    ({"lora__rank": -4}, r"lora\.rank"),
    ({"lora__alpha": 0}, r"lora\.alpha"),
    ({"lora__dropout": 1.0}, r"lora\.dropout"),
    ({"lora__target_modules": '["wq", "w_nope"]'}, r"\['w_nope'\] match no module"),
    ({"lora__target_modules": '["attention"]'}, r"layers\.0\.attention \(Attention\), not a linear"),
    ({"lora__target_modules": '["output"]'}, r"output \(Linear\), a linear whose weight the model reads"),
    ({"lora__experts": True}, r"lora\.experts = true"),
])
def test_bad_lora_settings_are_refused_in_one_line_and_nothing_is_written(extra, message, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    before = snapshot(tmp_path)
    line = refusal_line(capsys, ["train", *tiny_args(tmp_path / "run", lora__enable=True, **extra)])
    assert "ConfigError" in line and __import__("re").search(message, line), line
    assert snapshot(tmp_path) == before


def test_export_refuses_peft_and_merge_without_adapters_and_an_existing_output(tmp_path, capsys):
    plain = train_tiny(tmp_path / "plain", steps=1)
    for flags in (["--format", "peft"], ["--format", "hf", "--merge"]):
        line = refusal_line(capsys, ["export", "--checkpoint", str(plain), "--output", str(tmp_path / "x"), *flags])
        assert "holds no LoRA adapters" in line, line
    line = refusal_line(capsys, ["export", "--checkpoint", str(plain), "--output", str(tmp_path / "x"), "--format",
                                 "peft", "--merge"])
    assert "--merge with --format peft" in line and not (tmp_path / "x").exists(), line
    lora = train_tiny(tmp_path / "lora", steps=1, **LORA)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    before = snapshot(tmp_path)
    line = refusal_line(capsys, ["export", "--checkpoint", str(lora), "--format", "peft", "--output",
                                 str(tmp_path / "mine")])
    assert "--output" in line and snapshot(tmp_path) == before, line


def test_generate_and_eval_read_a_lora_checkpoint_as_its_merged_model(tmp_path):
    from titan_npu.checkpoint.formats import read_weights

    ckpt = train_tiny(tmp_path, steps=2, **LORA) / "step-2"
    read = read_weights(ckpt).state_dict
    assert not any(k.endswith(".lora_A") for k in read)
    # --format pt writes the model the run trained, merged, with or without --merge: its one state dict is what
    # generate, eval and import read back (a file of base weights and adapters would fit no model).
    for flags, name in (["--merge"], "merged.pt"), ([], "plain.pt"):
        assert main(["export", "--checkpoint", str(ckpt), "--format", "pt", *flags, "--dtype", "fp32", "--output",
                     str(tmp_path / name)]) == 0
        merged = torch.load(tmp_path / name, weights_only=True)
        assert read.keys() == merged.keys()
        assert all(torch.equal(read[k], merged[k]) for k in read)
        assert read_weights(tmp_path / name).state_dict.keys() == read.keys()

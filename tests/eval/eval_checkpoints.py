"""Tiny checkpoints the evaluation tests share: a DCP checkpoint of a dense (llama) or MoE (qwen3_moe) model with
weights well away from init, a config beside it and a small BPE tokenizer.json (so that lm_eval's Hugging Face
backend can read the same tokens from an export)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB = 320
MODELS = {
    "llama": ['name = "llama3"', "dim = 64", "n_layers = 2", "n_heads = 4", "n_kv_heads = 2"],
    "qwen3_moe": ['name = "qwen3_moe"', "dim = 64", "n_layers = 2", "n_heads = 4", "n_kv_heads = 2", "head_dim = 16",
                  "n_experts = 4", "top_k = 2", "moe_ffn_dim = 32", "capacity_factor = 0"],
}


def tokenizer_json(path: Path) -> Path:
    """A byte-level BPE tokenizer.json of VOCAB ids (BOS/EOS included) trained on the shipped tasks' text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_npu.eval.harness import SHIPPED_DIR

    texts = [line for f in sorted(SHIPPED_DIR.glob("*.jsonl")) for line in f.read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def tiny_checkpoint(tmp_path: Path, family: str, seed: int = 0, max_seq_len: int = 64) -> Path:
    """tmp_path/ckpt: a DCP checkpoint of `family` (init-weights' weights, randomised, saved as a checkpoint the
    way storage publishes one), its config.toml beside."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from titan_npu.checkpoint import storage
    from titan_npu.checkpoint.formats import read_weights
    from titan_npu.cli import main

    tok = tokenizer_json(tmp_path / "tokenizer.json")
    config = tmp_path / "config.toml"
    config.write_text("\n".join(["[model]", *MODELS[family], f"vocab_size = {VOCAB}", f"max_seq_len = {max_seq_len}",
                                 "[training]", 'dtype = "fp32"', "[data]", f'tokenizer = "{tok}"', ""]))
    seed_ckpt, ckpt = tmp_path / "seed", tmp_path / "ckpt"
    assert main(["init-weights", "--config", str(config), "--output", str(seed_ckpt)]) == 0
    state = read_weights(seed_ckpt).state_dict
    gen = torch.Generator().manual_seed(seed)
    for name, p in state.items():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    tmp = tmp_path / f"ckpt{storage.TMP_SUFFIX}"
    dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
    shutil.copy(seed_ckpt / storage.CONFIG_FILE, tmp / storage.CONFIG_FILE)
    info = {k: v for k, v in storage.read_info(seed_ckpt).items() if k not in ("format", "version", "files")}
    storage.publish(tmp, ckpt, info)
    assert json.loads((ckpt / "checkpoint.json").read_text())["model_args"]["vocab_size"] == VOCAB
    return ckpt

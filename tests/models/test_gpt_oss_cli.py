"""A gpt-oss Hugging Face directory through the commands a user types: `titan-npu import` prints the [model] lines
(sliding window, layer types, SwiGLU clamp and YaRN included), `train.py` starts from the directory itself
(checkpoint.initial_load; the fused experts are read whole, then split) at transformers' loss, and `titan-npu export
--format hf` writes a directory that transformers loads as the same model with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import (
    export_and_compare,
    first_step_is_the_references,
    train_from_the_import,
)

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.gpt_oss.args import FULL, SLIDING, GptOssArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# The tiny run's byte tokenizer (vocab 512) and seq 32: a window of 8, two sliding layers then a full one, YaRN.
ARGS = GptOssArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, ffn_dim=32,
                  moe_ffn_dim=32, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=64, family="gpt_oss", n_experts=4,
                  top_k=2, sliding_window=8, layer_types=[SLIDING, SLIDING, FULL], swiglu_limit=3.0,
                  router_aux_loss_coef=0.01, yarn_factor=4.0, yarn_original_seq_len=16)


def _hf_dir(path: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**get_spec("gpt_oss").hf.config(ARGS))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else (0.3 if "router." in name or "sinks" in name else 0.05)
                    * noise)
    model.save_pretrained(path)
    return model


def test_import_train_from_the_hf_directory_and_export_back(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    for line in ('name = "gpt_oss"', "n_experts = 4", "top_k = 2", "moe_ffn_dim = 32", "sliding_window = 8",
                 'layer_types = ["sliding_attention", "sliding_attention", "full_attention"]', "swiglu_limit = 3.0",
                 "yarn_factor = 4.0", "yarn_original_seq_len = 16", "yarn_truncate = false"):
        assert line in lines

    output, records = train_from_the_import(lines, tmp_path, steps=3)
    first_step_is_the_references(hf, records[0], tmp_path, aux=True)

    ours = build_model(ARGS)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / "step-3").state_dict, strict=True)
    back = export_and_compare(tmp_path, ours)
    assert back.config.model_type == "gpt_oss" and back.config.layer_types == ARGS.layer_types

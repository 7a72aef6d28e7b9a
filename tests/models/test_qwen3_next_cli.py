"""A Qwen3-Next Hugging Face directory through the commands a user types: `titan-npu import` prints the [model]
lines (layer types, the linear layers' heads, the shared expert, the projection layout), `train.py` starts from the
directory itself (checkpoint.initial_load) at transformers' loss, and `titan-npu export --format hf` writes a
directory that transformers loads as the same model with the same logits."""

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
from titan_npu.models.qwen3_next.args import Qwen3NextArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# The tiny run's byte tokenizer (vocab 512) and seq 32: linear, full, linear; two key heads serving four value heads.
ARGS = Qwen3NextArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, ffn_dim=48,
                     norm_eps=1e-6, rope_theta=10000.0, max_seq_len=64, family="qwen3_next", n_experts=4, top_k=2,
                     moe_ffn_dim=32, shared_ffn_dim=16, router_aux_loss_coef=0.01, full_attention_interval=2,
                     linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=16, linear_v_head_dim=8)


def _hf_dir(path: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**get_spec("qwen3_next").hf.config(ARGS))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("linear_attn.norm.weight") else
                    (0.1 if "norm" in name else 0.3 if "mlp.gate." in name or "A_log" in name else 0.05) * noise)
    model.save_pretrained(path)
    return model


def test_import_train_from_the_hf_directory_and_export_back(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    for line in ('name = "qwen3_next"', "n_experts = 4", "shared_ffn_dim = 16", "linear_n_k_heads = 2",
                 "linear_n_v_heads = 4", "partial_rotary_factor = 0.25", 'variant = "qwen3_next"',
                 'layer_types = ["linear_attention", "full_attention", "linear_attention"]'):
        assert line in lines

    output, records = train_from_the_import(lines, tmp_path, steps=3)
    first_step_is_the_references(hf, records[0], tmp_path, aux=True)

    ours = build_model(ARGS)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / "step-3").state_dict, strict=True)
    back = export_and_compare(tmp_path, ours)
    assert back.config.model_type == "qwen3_next" and back.config.layer_types == ARGS.layer_types

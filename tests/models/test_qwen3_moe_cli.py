"""A Qwen3-MoE Hugging Face directory (one tensor per expert) through the commands a user types: `titan-npu import`
prints the [model] lines, `train.py` starts from the directory itself (checkpoint.initial_load, read shard-wise
into the stacked experts) at transformers' loss, and `titan-npu export --format hf` writes a directory that
transformers loads as the same model with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import cross_entropy, export_and_compare, first_batch, train_from_the_import

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.qwen3_moe.args import MoEDecoderArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# The tiny run's byte tokenizer (vocab 512) and seq 32; layer 0 dense by the sparse step, layers 1 and 3 MoE.
ARGS = MoEDecoderArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512, ffn_dim=96,
                      norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qk_norm=True, family="qwen3_moe",
                      n_experts=4, top_k=2, moe_ffn_dim=32, decoder_sparse_step=2, router_aux_loss_coef=0.01)


def _hf_dir(path: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**get_spec("qwen3_moe").hf.config(ARGS))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else (0.3 if "gate." in name else 0.05) * noise)
    model.save_pretrained(path)
    return model


def test_import_train_from_the_hf_directory_and_export_back(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    for line in ('name = "qwen3_moe"', "n_experts = 4", "top_k = 2", "moe_ffn_dim = 32", "decoder_sparse_step = 2",
                 "mlp_only_layers = []", "router_aux_loss_coef = 0.01"):
        assert line in lines

    output, records = train_from_the_import(lines, tmp_path, steps=3)
    assert "shard-wise" in output  # read by the shard-wise reader (experts stacked)
    inputs, labels = first_batch(tmp_path)
    with torch.no_grad():
        out = hf(inputs, output_router_logits=True)
    ce, aux = cross_entropy(out.logits, labels), out.aux_loss.item()
    assert abs(records[0]["loss"] - ce) <= 1e-5 * ce  # the logged loss: the imported model's cross entropy
    assert abs(records[0]["aux_loss"] - aux) <= 1e-5 * aux

    ours = build_model(ARGS)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / "step-3").state_dict, strict=True)
    back = export_and_compare(tmp_path, ours)
    assert back.config.model_type == "qwen3_moe" and back.config.num_experts == ARGS.n_experts

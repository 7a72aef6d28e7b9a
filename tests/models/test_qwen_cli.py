"""A Qwen3 Hugging Face directory through the commands a user types: `titan-npu import` names the family and prints
the config lines, `train.py` starts from the directory itself (checkpoint.initial_load) at the model's own loss,
and `titan-npu export --format hf` writes a directory that transformers' Auto classes load as the same model_type
with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import cross_entropy, export_and_compare, first_batch, train_from_the_import

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# Shapes the tiny run's byte tokenizer (vocab 512) and seq 32 fit; head_dim 32 with dim 64 / 4 heads (not 16).
SHAPES = {
    "qwen3": DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512, ffn_dim=96,
                         norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qk_norm=True, tie_embeddings=True,
                         family="qwen3"),
    "qwen2": DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=96, norm_eps=1e-6,
                         rope_theta=1000000.0, max_seq_len=64, qkv_bias=True, family="qwen2"),
}


def _hf_dir(args: DecoderArgs, path: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**get_spec(args.family).hf.config(args))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    model.save_pretrained(path)
    return model


# Qwen3 (tied, q/k norms, head_dim apart) end to end; Qwen2's directory path is in test_qwen_hf_parity.py.
@pytest.mark.parametrize("family", ["qwen3"])
def test_import_train_from_the_hf_directory_and_export_back(family, tmp_path, capsys):
    args = SHAPES[family]
    hf = _hf_dir(args, tmp_path / "hf")

    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    assert f'name = "{family}"' in lines and f"head_dim = {args.head_dim}" in lines
    assert f"qk_norm = {str(args.qk_norm).lower()}" in lines and f"qkv_bias = {str(args.qkv_bias).lower()}" in lines
    assert f"tie_embeddings = {str(args.tie_embeddings).lower()}" in lines

    # The printed [model] lines, as the user pastes them, plus a run that starts from the HF directory itself.
    output, records = train_from_the_import(lines, tmp_path, steps=4)
    assert "initial_load: this rank read" in output  # the slice-wise HF read
    # The step-1 loss is the imported model's: far below a fresh model's ln(512) = 6.24 would be no proof, so
    # compare with transformers on the run's own first batch instead: the same tokens the loader gives first.
    inputs, labels = first_batch(tmp_path)
    with torch.no_grad():
        first_batch_loss = cross_entropy(hf(inputs).logits, labels)
    assert abs(records[0]["loss"] - first_batch_loss) <= 1e-4 * first_batch_loss

    ours = build_model(args)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / "step-4").state_dict, strict=True)
    ours.tie_weights()
    back = export_and_compare(tmp_path, ours)
    assert back.config.model_type == family
    assert back.config.tie_word_embeddings == args.tie_embeddings

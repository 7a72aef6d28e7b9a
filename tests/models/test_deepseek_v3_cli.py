"""A DeepSeek-V3 Hugging Face directory (one tensor per expert, a nonzero score bias) through the commands a user
types: `titan-npu import` prints the [model] lines, `train.py` starts from the directory itself
(checkpoint.initial_load, read shard-wise, the score bias included) at transformers' loss, and `titan-npu export
--format hf` writes a directory that transformers loads as the same model with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import cross_entropy, export_and_compare, first_batch, train_from_the_import

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.deepseek_v3.args import DeepSeekArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# The tiny run's byte tokenizer (vocab 512) and seq 32; layer 0 dense, layers 1-2 MoE in 4 groups; YaRN (not a
# flavor's: the printed [model] lines must carry it).
ARGS = DeepSeekArgs(dim=64, n_layers=3, n_heads=4, vocab_size=512, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
                    max_seq_len=64, family="deepseek_v3", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=12, n_experts=8, top_k=2, moe_ffn_dim=24, n_shared_experts=1,
                    n_groups=4, topk_groups=2, route_scale=2.5, first_k_dense=1, yarn_factor=4.0,
                    yarn_original_seq_len=16, yarn_mscale=1.0, yarn_mscale_all_dim=0.8)


def _hf_dir(path: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**get_spec("deepseek_v3").hf.config(ARGS))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else (0.3 if "gate." in name else 0.05) * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)
    return model


def test_import_train_from_the_hf_directory_and_export_back(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    for line in ('name = "deepseek_v3"', "n_experts = 8", "q_lora_rank = 24", "kv_lora_rank = 16", "v_head_dim = 12",
                 "n_groups = 4", "topk_groups = 2", "route_scale = 2.5", "first_k_dense = 1", "yarn_factor = 4.0",
                 "yarn_mscale_all_dim = 0.8"):
        assert line in lines
    output, records = train_from_the_import(lines, tmp_path, steps=3)
    assert "shard-wise" in output
    inputs, labels = first_batch(tmp_path)
    with torch.no_grad():
        ce = cross_entropy(hf(inputs).logits, labels)
    assert abs(records[0]["loss"] - ce) <= 1e-5 * ce  # the imported model (score bias included) is transformers'

    ours = build_model(ARGS)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / "step-3").state_dict, strict=True)
    back = export_and_compare(tmp_path, ours)
    assert back.config.model_type == "deepseek_v3" and back.config.n_routed_experts == ARGS.n_experts

"""A GLM-4.5 Hugging Face directory through the commands a user types: `titan-npu import` prints the [model] lines
(partial RoPE, q/k norms and biases, the routing), `train.py` starts from the directory itself
(checkpoint.initial_load) at transformers' loss and moves the score-correction biases, and `titan-npu export --format
hf` writes a directory that transformers loads as the same model with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import export_and_compare, first_step_is_the_references, randomise, train_from_the_import

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.glm4_moe.args import Glm4MoeArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# The tiny run's byte tokenizer (vocab 512) and seq 32: the first layer dense, 8 experts in 2 groups.
ARGS = Glm4MoeArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, ffn_dim=96,
                   norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, family="glm4_moe", qkv_bias=True, qk_norm=True,
                   partial_rotary_factor=0.5, n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_groups=2,
                   topk_groups=1, route_scale=2.5, first_k_dense=1)


def _hf_dir(path: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**get_spec("glm4_moe").hf.config(ARGS))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise(model, 0, scale=0.05, norm_scale=0.1)
    model.save_pretrained(path)
    return model


def test_import_train_from_the_hf_directory_and_export_back(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    for line in ('name = "glm4_moe"', "partial_rotary_factor = 0.5", "qkv_bias = true", "qk_norm = true",
                 "n_experts = 8", "n_shared_experts = 1", "n_groups = 2", "route_scale = 2.5", "first_k_dense = 1"):
        assert line in lines

    output, records = train_from_the_import(lines, tmp_path, steps=3)
    first_step_is_the_references(hf, records[0], tmp_path)

    ours = build_model(ARGS)
    trained = read_weights(tmp_path / "ckpt" / "step-3").state_dict
    ours.load_state_dict(trained, strict=True)
    assert trained["layers.1.feed_forward.router.score_bias"].abs().sum() > 0  # aux-loss-free balancing moved it
    back = export_and_compare(tmp_path, ours)
    assert back.config.model_type == "glm4_moe" and back.config.first_k_dense_replace == 1

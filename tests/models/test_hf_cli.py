"""A Hugging Face directory of each family through the commands a user types: `titan-npu import` names the family
and prints the [model] lines, `train.py` starts from the directory itself (checkpoint.initial_load; MoE experts
read shard-wise into their stacked tensors, DeepSeek-V3's score bias included) at transformers' loss on the run's
first batch, and `titan-npu export --format hf` writes a directory that transformers' Auto classes load as the same
model_type with the same logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import (
    export_and_compare,
    first_step_is_the_references,
    train_from_the_import,
)

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.deepseek_v3.args import DeepSeekArgs
from titan_npu.models.moe_decoder.args import MoEDecoderArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")


@dataclass(frozen=True)
class Case:
    """One family's directory, what its import prints and how its run and export are checked."""

    args: Any  # shapes the tiny run's byte tokenizer (vocab 512) and seq 32 fit
    printed: tuple[str, ...]  # [model] lines the import prints
    steps: int
    read: str  # what train.py says of the initial load
    loss_rtol: float  # the first logged loss against transformers' cross entropy on that batch
    exported: dict[str, Any]  # config fields of the exported directory


CASES = {
    # Tied, q/k norms, head_dim 32 with dim 64 / 4 heads (not 16); Qwen2's directory path is in test_hf_parity.py.
    "qwen3": Case(
        DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512, ffn_dim=96,
                    norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qk_norm=True, tie_embeddings=True,
                    family="qwen3"),
        ('name = "qwen3"', "head_dim = 32", "qk_norm = true", "qkv_bias = false", "tie_embeddings = true"),
        steps=4, read="initial_load: this rank read", loss_rtol=1e-4,
        exported={"model_type": "qwen3", "tie_word_embeddings": True}),
    # Layer 0 dense by the sparse step, layers 1 and 3 MoE; one tensor per expert on disk.
    "qwen3_moe": Case(
        MoEDecoderArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=512, ffn_dim=96,
                       norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qk_norm=True, family="qwen3_moe",
                       n_experts=4, top_k=2, moe_ffn_dim=32, decoder_sparse_step=2, router_aux_loss_coef=0.01),
        ('name = "qwen3_moe"', "n_experts = 4", "top_k = 2", "moe_ffn_dim = 32", "decoder_sparse_step = 2",
         "mlp_only_layers = []", "router_aux_loss_coef = 0.01"),
        steps=3, read="shard-wise", loss_rtol=1e-5, exported={"model_type": "qwen3_moe", "num_experts": 4}),
    # Layer 0 dense, layers 1-2 MoE in 4 groups, a nonzero score bias; YaRN (not a flavor's: the printed [model]
    # lines must carry it).
    "deepseek_v3": Case(
        DeepSeekArgs(dim=64, n_layers=3, n_heads=4, vocab_size=512, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
                     max_seq_len=64, family="deepseek_v3", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=12, n_experts=8, top_k=2, moe_ffn_dim=24, n_shared_experts=1,
                     n_groups=4, topk_groups=2, route_scale=2.5, first_k_dense=1, yarn_factor=4.0,
                     yarn_original_seq_len=16, yarn_mscale=1.0, yarn_mscale_all_dim=0.8),
        ('name = "deepseek_v3"', "n_experts = 8", "q_lora_rank = 24", "kv_lora_rank = 16", "v_head_dim = 12",
         "n_groups = 4", "topk_groups = 2", "route_scale = 2.5", "first_k_dense = 1", "yarn_factor = 4.0",
         "yarn_mscale_all_dim = 0.8"),
        steps=3, read="shard-wise", loss_rtol=1e-5, exported={"model_type": "deepseek_v3", "n_routed_experts": 8}),
}


def _hf_dir(args: Any, path: Path) -> torch.nn.Module:
    """transformers' model of `args` with weights away from init (router logits of order 1, a nonzero score bias),
    saved to `path`."""
    config = transformers.AutoConfig.for_model(**get_spec(args.family).hf.config(args))
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


@pytest.mark.parametrize("family", list(CASES))
def test_import_train_from_the_hf_directory_and_export_back(family, tmp_path, capsys):
    case = CASES[family]
    hf = _hf_dir(case.args, tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out
    for line in case.printed:
        assert line in lines

    # The printed [model] lines, as the user pastes them, plus a run that starts from the HF directory itself.
    output, records = train_from_the_import(lines, tmp_path, steps=case.steps)
    assert case.read in output
    # The step-1 loss is the imported model's: below a fresh model's ln(512) = 6.24 would be no proof, so compare
    # with transformers on the run's own first batch: the same tokens the loader gives first.
    first_step_is_the_references(hf, records[0], tmp_path, case.loss_rtol, aux=family == "qwen3_moe")

    ours = build_model(case.args)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / f"step-{case.steps}").state_dict, strict=True)
    ours.tie_weights()
    back = export_and_compare(tmp_path, ours)
    for field, value in case.exported.items():
        assert getattr(back.config, field) == value, field

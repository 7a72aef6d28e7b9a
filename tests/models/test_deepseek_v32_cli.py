"""A DeepSeek-V3.2 (and, marked slow, a GLM-5) Hugging Face directory through the commands a user types:
`titan-npu import` prints the [model] lines with the indexer's, train.py starts from the directory (shard-wise,
indexers included) at transformers' loss and trains in the sparse stage, `titan-npu export --format hf` gives a
directory transformers loads with the same logits; a directory whose indexer weights are missing is refused in one
line with nothing written."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import export_and_compare, first_step_is_the_references, save_hf_dir, train_from_the_import

from titan_npu.checkpoint.formats import read_weights
from titan_npu.cli import main
from titan_npu.models.deepseek_v32.args import DSAArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")

# The tiny run's byte tokenizer (vocab 512) and seq 32; each query keeps 8 keys.
ARGS = DSAArgs(dim=64, n_layers=2, n_heads=4, vocab_size=512, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
               max_seq_len=64, family="deepseek_v32", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, n_experts=4, top_k=2, moe_ffn_dim=24, n_shared_experts=1,
               n_groups=2, topk_groups=1, route_scale=2.5, first_k_dense=1, index_n_heads=4, index_head_dim=16,
               index_topk=8)


# GLM-5's layout: interleaved indexer RoPE, layer 1 reusing layer 0's selection.
GLM5 = dataclasses.replace(ARGS, variant="glm_moe_dsa", indexer_types=["full", "shared"])


def _hf_model(args: DSAArgs = ARGS) -> torch.nn.Module:
    """transformers' model of `args` (DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM) with weights away from
    init."""
    config = transformers.AutoConfig.for_model(**get_spec("deepseek_v32").hf.config(args))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else (0.3 if "gate." in name else 0.05) * noise)
    return model


@pytest.mark.parametrize(("args", "printed_lines"), [
    pytest.param(ARGS, ('variant = "deepseek_v32"',), id="deepseek_v32"),
    pytest.param(GLM5, ('variant = "glm_moe_dsa"', 'indexer_types = ["full", "shared"]'), id="glm5",
                 marks=pytest.mark.slow),
])
def test_import_train_in_the_sparse_stage_from_the_hf_directory_and_export_back(args, printed_lines, tmp_path,
                                                                                 capsys):
    hf = _hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    printed = capsys.readouterr().out
    for line in ('name = "deepseek_v32"', "index_n_heads = 4", "index_head_dim = 16", "index_topk = 8",
                 'dsa_stage = "sparse"', "q_lora_rank = 24", *printed_lines):
        assert line in printed
    output, records = train_from_the_import(printed, tmp_path, steps=3)
    assert "shard-wise" in output
    first_step_is_the_references(hf, records[0], tmp_path, 1e-5)
    ours = build_model(args)
    trained = read_weights(tmp_path / "ckpt" / "step-3").state_dict
    ours.load_state_dict(trained, strict=True)
    imported = get_spec("deepseek_v32").hf.from_hf(hf.state_dict(), args)
    name = "layers.0.attention.indexer.wq_b.weight"
    assert not torch.equal(trained[name], imported[name])  # the indexer learned in the sparse stage
    back = export_and_compare(tmp_path, ours.eval())
    assert back.config.model_type == args.variant and back.config.index_topk == 8


def test_an_hf_directory_without_the_indexer_weights_is_refused_in_one_line_writing_nothing(tmp_path, capsys):
    spec = get_spec("deepseek_v32")
    state = {k: v for k, v in _hf_model().state_dict().items() if ".indexer." not in k}
    save_hf_dir(state, spec.hf.config(ARGS), tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks the lightning indexer's weights of layer 0" in err[0], err
    assert not (tmp_path / "w.pt").exists()

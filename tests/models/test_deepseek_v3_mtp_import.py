"""A DeepSeek-V3 Hugging Face directory whose config.json asks for multi-token-prediction layers its weights lack
(transformers' save_pretrained writes none) imports at the mtp_depth its weights fill, saying so in one line, and
trains and exports from the command line; a model asking for more MTP layers than a checkpoint holds is refused
naming model.mtp_depth. (The import -> train -> export round trip with a score bias is test_hf_cli.py's case.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hf_reference import cross_entropy, export_and_compare, first_batch, randomise, train_from_the_import
from safetensors import safe_open
from safetensors.torch import save_file

from titan_npu.checkpoint.formats import read_weights
from titan_npu.checkpoint.initial_load import load_initial_weights
from titan_npu.cli import main
from titan_npu.errors import CheckpointError
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

# transformers' own DeepseekV3Config at the tiny run's sizes; every other field is its default, which asks for one
# multi-token-prediction layer (num_nextn_predict_layers = 1) that its model does not have.
TINY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                   topk_group=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=12, first_k_dense_replace=1, max_position_embeddings=64)

def test_a_save_pretrained_directory_imports_without_the_absent_mtp_layer_trains_and_exports(tmp_path, capsys):
    config = transformers.DeepseekV3Config(**TINY_CONFIG)
    assert config.num_nextn_predict_layers == 1
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomise(hf, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    printed = capsys.readouterr().out
    assert "mtp_depth = 0" in printed
    assert "asks for 1 multi-token-prediction layer(s) (num_nextn_predict_layers) but layer 3 is absent" in printed

    # A model that keeps the config's MTP layer is refused in one line naming mtp_depth, never n_layers: from the
    # import and from the directory itself (read shard-wise).
    asked = get_spec("deepseek_v3").hf.args_from_config(config.to_dict())
    assert asked.mtp_depth == 1
    for source in (tmp_path / "w.pt", tmp_path / "hf"):
        with pytest.raises(CheckpointError, match=r"holds 0 whole multi-token-prediction layer\(s\) \(layers\.3 on\), "
                           r"the model 1 \(model\.mtp_depth\): set model\.mtp_depth=0$") as refused:
            load_initial_weights(build_model(asked), source, asked)
        assert "n_layers" not in str(refused.value)

    # The printed lines as they stand start a run from the import at transformers' loss.
    _, records = train_from_the_import(printed, tmp_path, steps=2, initial_load=tmp_path / "w.pt")
    inputs, labels = first_batch(tmp_path)
    with torch.no_grad():
        ce = cross_entropy(hf(inputs).logits, labels)
    assert abs(records[0]["loss"] - ce) <= 1e-5 * ce

    # Export writes the model trained, no MTP layer, and a config.json that says so.
    held = read_weights(tmp_path / "hf").args
    ours = build_model(held)
    ours.load_state_dict(read_weights(tmp_path / "ckpt" / "step-2").state_dict, strict=True)
    back = export_and_compare(tmp_path, ours)
    assert back.config.num_nextn_predict_layers == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert not any(k.startswith("model.layers.3.") for k in _hf_names(tmp_path / "out"))

def _hf_names(path: Path) -> list[str]:
    """The tensor names of a Hugging Face safetensors directory."""
    names = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names += list(handle.keys())
    return names

@pytest.mark.parametrize("asked, dropped, held, line", [
    (1, ("self_attn.o_proj.weight", "eh_proj.weight"), 0, "layer 3 is partial ({} of {} tensors) in the weights: "
                                                          "model.mtp_depth = 0, layer(s) 3 set aside"),
    (2, (), 1, "asks for 2 multi-token-prediction layer(s) (num_nextn_predict_layers) but layer 4 is absent in the "
               "weights: model.mtp_depth = 1"),
], ids=["partial-layer", "depth-2-one-layer"])
def test_mtp_layers_the_weights_lack_or_hold_in_part_import_as_the_depth_they_fill(tmp_path, capsys, asked, dropped,
                                                                                  held, line):
    one = dataclasses.replace(ARGS, mtp_depth=1)
    model = build_model(one)
    randomise(model, seed=5)
    spec = get_spec("deepseek_v3")
    tensors = {k: v.clone() for k, v in spec.hf.to_hf(model.state_dict(), one).items()
               if k not in {f"model.layers.3.{name}" for name in dropped}}
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(spec.hf.config(dataclasses.replace(ARGS,
                                                                                              mtp_depth=asked))))
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    printed = capsys.readouterr().out
    per_layer = sum(1 for k in model.state_dict() if k.startswith("layers.3."))
    assert line.format(per_layer - len(dropped), per_layer) in printed and f"mtp_depth = {held}" in printed
    fills = dataclasses.replace(ARGS, mtp_depth=held)
    kept = build_model(fills).state_dict()
    assert torch.load(tmp_path / "w.pt").keys() == kept.keys()
    # initial_load takes the directory itself (read shard-wise) and the import at that depth, with the weights they
    # hold.
    for source in (tmp_path / "hf", tmp_path / "w.pt"):
        loaded = build_model(fills)
        load_initial_weights(loaded, source, fills)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())

"""LoRA through the commands a user types, held to peft: a Hugging Face directory is imported (checkpoint.initial_load),
trained with [lora], and exported as the base (`--format hf`), the adapters (`--format peft`) and the merged model
(`--format hf --merge`). peft's PeftModel.from_pretrained on the exported base, and transformers on the merged
directory, give our adapted model's logits (fp32, 1e-5); the training moved only the adapters (the frozen weights
are bit-identical to the imported ones)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import TINY_TRAIN_ARGS

from titan_npu.checkpoint.dcp_io import load_tensors, read_metadata, tensor_entries
from titan_npu.cli import main
from titan_npu.config.schema import LORA_DEFAULT_TARGETS, LoraConfig
from titan_npu.lora.apply import apply_lora
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.moe_decoder.args import MoEDecoderArgs
from titan_npu.models.registry import build_model, get_spec

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
TARGETS = {"qwen3": LORA_DEFAULT_TARGETS, "qwen3_moe": ["wq", "wk", "wv", "wo"]}
ARGS = {
    # q/k norms and heads permuted between the two RoPE layouts: the adapters' B rows follow W's.
    "qwen3": DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, ffn_dim=96,
                         norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qk_norm=True, tie_embeddings=True,
                         family="qwen3"),
    # Layer 0 dense, layer 1 MoE: adapters on attention, the experts frozen (peft 0.21 takes gate_proj / up_proj /
    # down_proj of a qwen3_moe model for its experts' fused tensors, so a dense layer's MLP adapters do not reach it).
    "qwen3_moe": MoEDecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=512, ffn_dim=96,
                                norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=64, qk_norm=True,
                                family="qwen3_moe", n_experts=4, top_k=2, moe_ffn_dim=32, decoder_sparse_step=2,
                                router_aux_loss_coef=0.01),
}


def _hf_dir(args: Any, path: Path) -> None:
    """transformers' model of `args`, weights away from init, saved to `path`."""
    config = transformers.AutoConfig.for_model(**get_spec(args.family).hf.config(args))
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    model.save_pretrained(path)


def _train_lora(tmp_path: Path, capsys, targets: list[str], steps: int = 3) -> None:
    """The [model] lines `titan-npu import` prints, a LoRA run of `steps` steps from the HF directory itself."""
    assert main(["import", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")]) == 0
    printed = capsys.readouterr().out
    model_lines = printed[printed.index("[model]"):printed.index("[checkpoint]")]
    (tmp_path / "run.toml").write_text(
        model_lines + f'\n[checkpoint]\ninitial_load = "{tmp_path / "hf"}"\ndir = "{tmp_path / "ckpt"}"\n'
        f'\n[metrics]\nlog_dir = "{tmp_path / "logs"}"\n\n[lora]\nenable = true\nrank = {RANK}\nalpha = {ALPHA}\n'
        f'target_modules = {json.dumps(targets)}\n')
    assert main(["train", "--config", str(tmp_path / "run.toml"), *TINY_TRAIN_ARGS, "--optimizer.lr", "2e-2",
                 "--training.max_steps", str(steps)]) == 0


def _export(tmp_path: Path, name: str, *flags: str) -> Path:
    out = tmp_path / name
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--dtype", "fp32", "--output", str(out),
                 *flags]) == 0
    return out


def _trained_state(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The run's last checkpoint's model entries as trained: the frozen weights and the adapters apart (an export
    --format pt writes them merged)."""
    step = max((tmp_path / "ckpt").glob("step-*"), key=lambda d: int(d.name.split("-")[1]))
    metadata = read_metadata(step)
    keys = ["model." + k for k in tensor_entries(metadata, "model.")]
    return {k[len("model."):]: v for k, v in load_tensors(step, metadata, keys).items()}


def _ours(args: Any, state: dict[str, torch.Tensor], targets: list[str]) -> torch.nn.Module:
    """Our model of `args` with adapters on `targets`, holding `state` (the run's exported weights and adapters)."""
    model = build_model(args)
    apply_lora(model, LoraConfig(enable=True, rank=RANK, alpha=ALPHA, target_modules=targets), LORA_DEFAULT_TARGETS)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("family", list(ARGS))
def test_peft_loads_our_adapters_onto_the_exported_base_with_our_logits(family, tmp_path, capsys):
    args = ARGS[family]
    _hf_dir(args, tmp_path / "hf")
    _train_lora(tmp_path, capsys, TARGETS[family])
    state = _trained_state(tmp_path)
    imported = torch.load(tmp_path / "w.pt", weights_only=True)
    adapters = {k for k in state if k.endswith((".lora_A", ".lora_B"))}
    # Only the adapters trained: every frozen weight is the imported one, bit for bit; every B moved from zero.
    assert set(state) - adapters == set(imported)
    assert all(torch.equal(state[k], imported[k].to(state[k].dtype)) for k in imported)
    assert all(state[k].abs().max() > 0 for k in adapters if k.endswith(".lora_B"))

    ours = _ours(args, state, TARGETS[family])
    tokens = torch.arange(64).remainder(args.vocab_size).reshape(2, 32)
    with torch.no_grad():
        expected = ours(tokens)
        base = transformers.AutoModelForCausalLM.from_pretrained(_export(tmp_path, "base", "--format", "hf")).eval()
        before = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, _export(tmp_path, "adapter", "--format", "peft")).eval()
        assert (adapted(tokens).logits - expected).abs().max().item() < 1e-5
        assert (before - expected).abs().max().item() > 1e-3  # the adapters change the function
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            _export(tmp_path, "merged", "--format", "hf", "--merge")).eval()
        assert (merged(tokens).logits - expected).abs().max().item() < 1e-5
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    n_adapted = len(adapters) // 2
    assert len(config["target_modules"]) == n_adapted


def test_a_moe_models_mlp_adapters_merge_exactly_but_are_not_written_for_peft(tmp_path, capsys):
    args = ARGS["qwen3_moe"]
    _hf_dir(args, tmp_path / "hf")
    _train_lora(tmp_path, capsys, LORA_DEFAULT_TARGETS)  # the dense layer's MLP too
    state = _trained_state(tmp_path)
    assert "layers.0.feed_forward.w1.lora_A" in state
    tokens = torch.arange(64).remainder(args.vocab_size).reshape(2, 32)
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            _export(tmp_path, "merged", "--format", "hf", "--merge")).eval()
        assert (merged(tokens).logits - _ours(args, state, LORA_DEFAULT_TARGETS)(tokens)).abs().max().item() < 1e-5
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "peft", "--output",
                 str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "adapters on the MLP of a MoE model" in err, err
    assert not (tmp_path / "adapter").exists()

"""Weights cross the Hugging Face and Meta formats both ways with the logits intact (fp32, max abs diff < 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from titan_npu.checkpoint.initial_load import load_initial_weights
from titan_npu.commands.export import main as export_main
from titan_npu.commands.import_weights import main as import_main
from titan_npu.errors import CheckpointError
from titan_npu.models.llama import Transformer, args_from_hf_config, hf_config

from .conftest import TINY, job_config, logits, model_manager, random_model, tokens_for

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max abs logit difference, fp32


def _hf_model(args, seed: int):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(args), attn_implementation="eager"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("shape", list(TINY))
def test_import_of_a_hugging_face_model_gives_its_logits(shape, tmp_path):
    args = TINY[shape]
    hf = _hf_model(args, seed=1)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ours.pt")]) == 0

    ours = Transformer(args_from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text())))
    ours.load_state_dict(torch.load(tmp_path / "ours.pt", weights_only=True), strict=True)
    tokens = tokens_for(args)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("shape", list(TINY))
def test_initial_load_reads_a_hugging_face_directory_directly(shape, tmp_path):
    args = TINY[shape]
    hf = _hf_model(args, seed=2)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = Transformer(args)
    load_initial_weights(ours, tmp_path / "hf", args)
    tokens = tokens_for(args, seed=3)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("shape", list(TINY))
def test_export_hf_of_a_checkpoint_loads_in_transformers_with_our_logits(shape, tmp_path):
    args = TINY[shape]
    model = random_model(args, seed=4)
    manager, *_ = model_manager(job_config(tmp_path), model, args)
    manager.save(7)
    out = tmp_path / "hf-export"
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--dtype", "fp32",
                        "--output", str(out)]) == 0

    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    tokens = tokens_for(args, seed=5)
    assert (logits(model, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_export_hf_shards_big_models_with_an_index(tmp_path):
    args = TINY["llama3-gqa"]
    model = random_model(args, seed=6)
    manager, *_ = model_manager(job_config(tmp_path), model, args)
    manager.save(1)
    out = tmp_path / "sharded"
    # ~50 KB per layer in bf16: a 40 KB limit forces several files.
    assert export_main(["--checkpoint", str(tmp_path / "ckpt" / "step-1"), "--format", "hf", "--output", str(out),
                        "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = Transformer(args)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    tokens = tokens_for(args, seed=7)
    assert (logits(reference, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def test_export_pt_is_a_full_state_dict_for_the_plain_model(tmp_path):
    args = TINY["llama2-mha"]
    model = random_model(args, seed=8)
    manager, *_ = model_manager(job_config(tmp_path), model, args)
    manager.save(3)
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--step", "3", "--format", "pt", "--dtype", "fp32",
                        "--output", str(tmp_path / "full.pt")]) == 0
    plain = Transformer(args)
    plain.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key


def _write_meta(model: Transformer, folder, n_shards: int, args) -> None:
    """Meta's layout: params.json and consolidated.NN.pth split like its model-parallel layers."""
    from titan_npu.models.llama.meta import _meta_shard_dim

    folder.mkdir()
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size if args.family == "llama3" else -1, "multiple_of": 32,
              "norm_eps": args.norm_eps, "rope_theta": args.rope_theta}
    (folder / "params.json").write_text(json.dumps(params))
    shards = [{"rope.freqs": torch.zeros(args.head_dim // 2)} for _ in range(n_shards)]
    for key, value in model.state_dict().items():
        dim = _meta_shard_dim(key, args)
        pieces = [value] * n_shards if dim is None else value.chunk(n_shards, dim=dim)
        for shard, piece in zip(shards, pieces):
            shard[key] = piece.clone()
    for i, shard in enumerate(shards):
        torch.save(shard, folder / f"consolidated.{i:02d}.pth")


@pytest.mark.parametrize("shape", list(TINY))
def test_import_of_meta_consolidated_shards_rebuilds_the_model(shape, tmp_path):
    args = TINY[shape]
    model = random_model(args, seed=9)
    _write_meta(model, tmp_path / "meta", n_shards=2, args=args)
    assert import_main(["--input", str(tmp_path / "meta"), "--output", str(tmp_path / "ours.pt")]) == 0
    loaded = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert set(loaded) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_initial_load_refuses_weights_with_other_head_counts(tmp_path):
    args = TINY["llama3-gqa"]
    hf = _hf_model(args, seed=10)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    other = TINY["llama2-mha"]  # same tensor shapes would not catch 4 vs 8 heads; the head check must
    fields = {k: getattr(args, k) for k in args.__dataclass_fields__}
    fields.update(n_heads=4, n_kv_heads=1)
    model_args = type(other)(**fields)
    with pytest.raises(CheckpointError, match=r"n_heads 8 vs 4.*set model.n_heads=8 and model.n_kv_heads=2"):
        load_initial_weights(Transformer(model_args), tmp_path / "hf", model_args)


def test_initial_load_of_another_model_size_names_shapes_and_cause(tmp_path):
    args = TINY["llama2-mha"]
    torch.save(random_model(args, seed=11).state_dict(), tmp_path / "small.pt")
    fields = {k: getattr(args, k) for k in args.__dataclass_fields__}
    bigger = type(args)(**{**fields, "dim": 128, "n_layers": 3})
    with pytest.raises(CheckpointError) as err:
        load_initial_weights(Transformer(bigger), tmp_path / "small.pt", bigger)
    message = str(err.value)
    assert "missing key(s) (e.g. layers.2." in message
    assert "shape mismatch(es) (e.g. tok_embeddings.weight: checkpoint (160, 64) vs model (160, 128)" in message
    assert "another model size" in message

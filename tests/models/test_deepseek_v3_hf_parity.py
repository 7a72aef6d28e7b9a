"""DeepSeek-V3 against Hugging Face transformers' DeepseekV3ForCausalLM (fp32, CPU): the same logits after import
and after export, and losses that track a plain transformers training loop for 20 steps from the imported weights;
an fp8 checkpoint with block scales imports dequantised."""

import json

import pytest
import torch
from hf_reference import (
    adamw_steps,
    hf_model,
    import_hf_model,
    logits,
    memorisable_batches,
    random_tokens,
    randomise,
    use_reference_kernels,
)

from titan_npu.checkpoint.formats import read_weights
from titan_npu.config.schema import ModelConfig
from titan_npu.errors import CheckpointError
from titan_npu.models.deepseek_v3.args import DeepSeekArgs
from titan_npu.models.registry import build_model, build_model_args, get_spec, spec_for_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32 (logits of unit scale)
STEP_RTOL = 1e-4  # each of 20 training steps' loss, relative (measured: at most 2e-6)
SEQ_LEN = 32

_BASE = dict(dim=64, n_layers=3, n_heads=4, vocab_size=160, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
             max_seq_len=128, family="deepseek_v3", kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, n_experts=8, top_k=2, moe_ffn_dim=24, n_shared_experts=1, n_groups=4, topk_groups=2,
             route_scale=2.5, first_k_dense=1)
SHAPES = {
    # A low-rank query, YaRN RoPE whose mscale and mscale_all_dim differ (both the cos/sin factor and the softmax
    # scale move), top-k weights renormalised.
    "q-lora-yarn": DeepSeekArgs(**_BASE, q_lora_rank=24, yarn_factor=4.0, yarn_original_seq_len=32,
                                yarn_mscale=1.0, yarn_mscale_all_dim=0.8),
    # A plain query projection, plain RoPE, weights not renormalised, 2 shared experts.
    "plain-q": DeepSeekArgs(**{**_BASE, "n_shared_experts": 2, "route_scale": 1.0}, q_lora_rank=0,
                            norm_topk_prob=False),
}


_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights well away from init (norms near 1, router logits of order 1, a nonzero score bias), so a wrong
    mapping shows."""
    randomise(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.3 / 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_model_counts_its_parameters_and_builds_the_layers_transformers_does(shape):
    args = SHAPES[shape]
    ours = build_model(args)
    assert sum(p.numel() for p in ours.parameters()) == args.num_params()
    hf = hf_model("deepseek_v3", args)
    assert sum(p.numel() for p in hf.parameters()) == args.num_params()
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe == [i for i in range(args.n_layers) if args.is_moe_layer(i)] == [1, 2]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_imported_give_hf_logits(shape):
    args = SHAPES[shape]
    hf = hf_model("deepseek_v3", args)
    _randomise(hf, seed=0)
    ours = import_hf_model("deepseek_v3", hf, args)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 1)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def _ce(model, tokens, labels):
    out = logits(model, tokens) if not torch.is_grad_enabled() else model(tokens)
    out = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("shape", ["q-lora-yarn", pytest.param("plain-q", marks=pytest.mark.slow)])
def test_twenty_steps_from_imported_weights_track_a_transformers_training_loop(shape):
    args = SHAPES[shape]
    hf = hf_model("deepseek_v3", args).train()
    _randomise(hf, seed=7)
    ours = import_hf_model("deepseek_v3", hf, args).train()
    batches = memorisable_batches(args.vocab_size, SEQ_LEN, 20, batch=2)
    ours_losses = adamw_steps(ours, batches, _ce)
    hf_losses = adamw_steps(hf, batches, _ce)
    assert ours_losses[-1] < ours_losses[0] - 1.0  # it learns: the comparison is not between two flat lines
    for step, (a, b) in enumerate(zip(ours_losses, hf_losses)):
        assert abs(a - b) <= STEP_RTOL * abs(b), f"step {step + 1}: ours {a} vs transformers {b}"


def _save(state: dict, config: dict, path):
    from safetensors.torch import save_file

    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def test_an_hf_directory_reads_by_its_model_type_and_exports_back_loadable_by_auto_model(tmp_path):
    args = SHAPES["q-lora-yarn"]
    hf = hf_model("deepseek_v3", args)
    _randomise(hf, seed=9)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert spec_for_hf_config(config).name == "deepseek_v3"
    weights = read_weights(tmp_path / "hf")
    assert weights.format == "hf" and weights.args == args
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    tokens = random_tokens(args.vocab_size, SEQ_LEN, 10)
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    spec = get_spec("deepseek_v3")
    exported = spec.hf.to_hf(ours.state_dict(), weights.args)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in exported
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in exported
    _save(exported, spec.hf.config(weights.args), tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    for field in ("q_lora_rank", "kv_lora_rank", "n_group", "topk_group", "routed_scaling_factor",
                  "first_k_dense_replace", "n_shared_experts", "v_head_dim"):
        assert getattr(back.config, field) == getattr(hf.config, field), field
    assert (logits(back, tokens) - logits(hf, tokens)).abs().max().item() < TOL


def _fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight quantised to fp8 e4m3 with one scale per block x block tile (the published checkpoint's format)."""
    rows, cols = (-(-n // block) for n in weight.shape)
    padded = torch.nn.functional.pad(weight, (0, cols * block - weight.shape[1], 0, rows * block - weight.shape[0]))
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    quant = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * block, cols * block)
    return quant[:weight.shape[0], :weight.shape[1]].contiguous(), scale


def test_an_fp8_checkpoint_with_block_scales_imports_dequantised(tmp_path):
    args = DeepSeekArgs(**{**_BASE, "dim": 160, "n_layers": 2}, q_lora_rank=0)  # 160: a partial 128-block
    hf = hf_model("deepseek_v3", args)
    _randomise(hf, seed=3)
    ours = import_hf_model("deepseek_v3", hf, args)
    state = {k: v for k, v in get_spec("deepseek_v3").hf.to_hf(ours.state_dict(), args).items()}
    quantised, expected = {}, {}
    for key, tensor in state.items():
        if key.endswith("proj.weight") and tensor.dim() == 2:
            quantised[key], quantised[f"{key}_scale_inv"] = _fp8_blocks(tensor)
            blocks = quantised[f"{key}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            expected[key] = quantised[key].float() * blocks[:tensor.shape[0], :tensor.shape[1]]
        else:
            quantised[key] = expected[key] = tensor
    config = {**get_spec("deepseek_v3").hf.config(args),
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    _save(quantised, config, tmp_path / "fp8")
    weights = read_weights(tmp_path / "fp8")
    want = get_spec("deepseek_v3").hf.from_hf(expected, args)
    assert weights.state_dict.keys() == want.keys()
    for key, tensor in want.items():
        assert weights.state_dict[key].dtype == torch.float32 and torch.equal(weights.state_dict[key], tensor), key
    # The dequantised weights are the original within fp8's rounding (3 mantissa bits).
    w = weights.state_dict["layers.0.attention.wq.weight"]
    original = state["model.layers.0.self_attn.q_proj.weight"]
    assert (w - original).abs().max() <= 0.07 * original.abs().max()


@pytest.mark.parametrize("flavor", ["debug", "16B", "236B", "671B"])
def test_a_published_config_reads_back_as_its_flavor_yarn_included(flavor):
    args = build_model_args(ModelConfig(name="deepseek_v3", flavor=flavor))
    back = get_spec("deepseek_v3").hf.args_from_config(get_spec("deepseek_v3").hf.config(args))
    assert back == args and back.flavor == flavor


def test_the_shard_wise_reader_refuses_fp8_in_one_line():
    args = SHAPES["plain-q"]
    with pytest.raises(CheckpointError, match="dequantise the checkpoint first with `titan-npu import`") as error:
        get_spec("deepseek_v3").hf.from_hf_layout("layers.0.attention.wq.weight",
                                                  torch.zeros(4, 4, dtype=torch.float8_e4m3fn), args)
    assert "\n" not in str(error.value)

"""Kimi K2 imports as DeepSeek-V3: its published config.json (model_type "kimi_k2" on DeepseekV3ForCausalLM, 384 routed
experts in one group, one dense layer, 64 heads, YaRN 32x with both ramp bounds at 1 rotation written as
rope_scaling "type") reads as the deepseek_v3 family's kimi-k2 flavor, and a tiny checkpoint shaped like it (one
group, the first layer dense, K2's YaRN on a sequence past the stretched context) gives transformers' logits."""

import pytest
import torch
from hf_reference import hf_model, import_hf_model, logits, random_tokens, randomise, save_hf_dir, use_reference_kernels

from titan_npu.checkpoint.formats import read_weights
from titan_npu.config.schema import ModelConfig
from titan_npu.models.deepseek_v3.args import DeepSeekArgs
from titan_npu.models.registry import build_model, build_model_args, get_spec, spec_for_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # max abs logit difference, fp32

_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)

# moonshotai/Kimi-K2-Instruct's config.json (Kimi-K2-Base's has the same architecture fields), as published.
K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "aux_loss_alpha": 0.001,
    "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}


def test_the_published_k2_config_reads_as_the_deepseek_v3_kimi_k2_flavor():
    spec = spec_for_hf_config(K2_CONFIG)
    args = spec.hf.args_from_config(K2_CONFIG)
    assert spec.name == "deepseek_v3" and args.flavor == "kimi-k2"
    assert (args.n_experts, args.top_k, args.n_groups, args.topk_groups, args.first_k_dense, args.n_heads) == \
        (384, 8, 1, 1, 1, 64)
    assert (args.yarn_factor, args.yarn_original_seq_len, args.yarn_beta_fast, args.yarn_beta_slow,
            args.yarn_mscale, args.yarn_mscale_all_dim, args.rope_theta) == (32.0, 4096, 1.0, 1.0, 1.0, 1.0, 50000.0)
    assert args.mtp_depth == 0 and args.route_scale == 2.827
    # 1T total, 32B active (Moonshot's figures); the flavor [model] name = "kimi_k2" selects is the same model.
    assert round(args.num_params() / 1e9) == 1026 and round(args.num_active_params() / 1e9) == 33
    assert build_model_args(ModelConfig(name="kimi_k2")) == args


# K2's shape in small: a low-rank query, one group of 12 experts (top-4), one shared, the first layer dense, its
# route scale and rope_theta, YaRN 4x from 16 positions with both ramp bounds at 1 rotation (K2's) and mscale = 1.
K2_TINY = DeepSeekArgs(dim=64, n_layers=3, n_heads=4, vocab_size=160, ffn_dim=96, norm_eps=1e-6, rope_theta=50000.0,
                       max_seq_len=128, family="deepseek_v3", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=12, n_experts=12, top_k=4, moe_ffn_dim=24, n_shared_experts=1,
                       n_groups=1, topk_groups=1, route_scale=2.827, first_k_dense=1, yarn_factor=4.0,
                       yarn_original_seq_len=16, yarn_beta_fast=1.0, yarn_beta_slow=1.0, yarn_mscale=1.0,
                       yarn_mscale_all_dim=1.0)


def test_a_tiny_k2_shaped_checkpoint_gives_transformers_logits(tmp_path):
    hf = hf_model("deepseek_v3", K2_TINY)
    randomise(hf, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    spec = get_spec("deepseek_v3")
    state = spec.hf.to_hf(import_hf_model("deepseek_v3", hf, K2_TINY).state_dict(), K2_TINY)
    # config.json as K2 writes it: its model_type, rope_scaling with "type", the published extra fields.
    config = {k: v for k, v in spec.hf.config(K2_TINY).items() if k != "rope_parameters"}
    config.update(model_type="kimi_k2", rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0,
                                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
                                                      "type": "yarn"},
                  aux_loss_alpha=0.001, moe_layer_freq=1, seq_aux=True, pretraining_tp=1)
    save_hf_dir(state, config, tmp_path / "hf")
    weights = read_weights(tmp_path / "hf")
    assert weights.args == K2_TINY
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    tokens = random_tokens(K2_TINY.vocab_size, 48, 2)  # 48 positions: 3x the context YaRN stretches from
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() < TOL
    plain = DeepSeekArgs(**{**K2_TINY.__dict__, "yarn_factor": None})
    unstretched = build_model(plain)
    unstretched.load_state_dict(weights.state_dict, strict=True)
    assert (logits(unstretched, tokens) - logits(hf, tokens)).abs().max().item() > 100 * TOL  # YaRN does matter

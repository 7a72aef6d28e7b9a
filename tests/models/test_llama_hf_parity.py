"""Our Llama computes the same logits as Hugging Face transformers' LlamaForCausalLM, weights mapped both ways."""

import pytest
import torch
from hf_reference import logits, randomise

from titan_npu import ops
from titan_npu.models.decoder.model import precompute_rope
from titan_npu.models.llama import LlamaArgs, Transformer, from_hf, hf_config, to_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max abs logit difference, fp32

SHAPES = {
    "llama2-mha": LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=160, ffn_dim=172, norm_eps=1e-5,
                            rope_theta=10000.0, max_seq_len=128, family="llama2"),
    "llama3-gqa": LlamaArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=160, ffn_dim=256,
                            norm_eps=1e-5, rope_theta=500000.0, max_seq_len=128, family="llama3"),
    "llama3.1-gqa-rope-scaling": LlamaArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=160,
                                           ffn_dim=256, norm_eps=1e-5, rope_theta=500000.0,
                                           rope_scaling_factor=8.0, max_seq_len=16384, family="llama3"),
}
SEQ_LEN = 96


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def _hf_model(args: LlamaArgs, attn_implementation: str):
    config = transformers.LlamaConfig(**hf_config(args), attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config).eval()


def _with_flash(args: LlamaArgs, use_flash: bool) -> LlamaArgs:
    fields = {k: getattr(args, k) for k in args.__dataclass_fields__}
    return LlamaArgs(**{**fields, "use_flash_attention": use_flash})


@pytest.mark.parametrize("use_flash", [True, False], ids=["flash", "eager"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_weights_loaded_through_from_hf_give_hf_logits(shape, attn_implementation, use_flash):
    args = _with_flash(SHAPES[shape], use_flash)
    hf = _hf_model(args, attn_implementation)
    randomise(hf, seed=0)
    ours = Transformer(args)
    ours.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    diff = (logits(ours, tokens) - logits(hf, tokens)).abs().max().item()
    assert diff < TOL


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_our_weights_exported_through_to_hf_give_our_logits_in_hf(shape, attn_implementation):
    args = SHAPES[shape]
    torch.manual_seed(2)
    ours = Transformer(args)
    ours.init_weights()
    randomise(ours, seed=3)
    hf = _hf_model(args, attn_implementation)
    hf.load_state_dict(to_hf(ours.state_dict(), args), strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(4))
    diff = (logits(ours, tokens) - logits(hf, tokens)).abs().max().item()
    assert diff < TOL


def test_the_parity_check_would_catch_a_missing_rope_permutation():
    args = SHAPES["llama3-gqa"]
    hf = _hf_model(args, "eager")
    randomise(hf, seed=5)
    ours = Transformer(args)
    ours.load_state_dict(_unpermuted_our_names(hf.state_dict()))
    tokens = torch.randint(0, args.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(6))
    assert (logits(ours, tokens) - logits(hf, tokens)).abs().max().item() > 100 * TOL


def _unpermuted_our_names(hf_state_dict):
    """HF tensors renamed to ours without the q/k row permutation."""
    args = SHAPES["llama3-gqa"]
    mapped = from_hf(hf_state_dict, args)
    for key in mapped:
        if key.endswith(("attention.wq.weight", "attention.wk.weight")):
            layer = key.split(".")[1]
            proj = "q_proj" if key.endswith("wq.weight") else "k_proj"
            mapped[key] = hf_state_dict[f"model.layers.{layer}.self_attn.{proj}.weight"]
    return mapped


def test_rope_scaling_frequencies_equal_hugging_faces_llama3_rope():
    args = SHAPES["llama3.1-gqa-rope-scaling"]
    config = transformers.LlamaConfig(**hf_config(args))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    cos, sin = precompute_rope(args.head_dim, 2, args.rope_theta, args.rope_scaling_factor)
    ours_inv_freq = torch.atan2(sin[1], cos[1])  # the angle at position 1 is the frequency itself
    torch.testing.assert_close(ours_inv_freq, hf_inv_freq, atol=1e-7, rtol=1e-5)


def test_rope_scaling_changes_logits_by_more_than_the_parity_tolerance():
    scaled = SHAPES["llama3.1-gqa-rope-scaling"]
    fields = {k: getattr(scaled, k) for k in scaled.__dataclass_fields__}
    unscaled = LlamaArgs(**{**fields, "rope_scaling_factor": None})
    torch.manual_seed(7)
    a = Transformer(scaled)
    randomise(a, seed=8)
    b = Transformer(unscaled)
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, scaled.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(9))
    assert (logits(a, tokens) - logits(b, tokens)).abs().max().item() > 10 * TOL

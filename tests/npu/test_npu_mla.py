"""DeepSeek-V3's multi-head latent attention on the (fake) NPU kernels: npu_fusion_attention on q/k of head dim
qk_nope + qk_rope and the value zero-padded to it, npu_rms_norm on the low-rank latents, npu_rotary_mul on the
RoPE slices of the query ([B, S, H, rope]) and on the key shared by the heads ([B, S, 1, rope]); the forward and
backward equal the reference kernels'. The published shapes' RoPE slice (128 heads x 64) and shared key run on
npu_rotary_mul within its B x N < 1000 limit and take the reference past it."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_npu.config.loader import load_config
from titan_npu.models.registry import build_model, build_model_args
from titan_npu.ops import set_kernels

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_deepseek.toml"
N_LAYERS = 2


def test_a_tiny_deepseek_forward_and_backward_on_the_npu_kernels_equals_the_reference(fake_torch_npu):
    # In-process: CPU tensors stand in for the NPU, with the npu kernels selected by name. The value (32 wide) is
    # padded to the q/k head dim (32 + 16) for the fused attention; the first layer is dense, the second MoE.
    cfg = load_config(CONFIG, ["--model.dim", "64", "--model.n_layers", str(N_LAYERS), "--model.max_seq_len", "32"])
    model = build_model(build_model_args(cfg.model))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))

    def forward_backward(kernels: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        set_kernels(kernels)
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fake_torch_npu.calls.clear()
    npu_logits, npu_grads = forward_backward("npu")
    assert fake_torch_npu.calls["npu_fusion_attention"] == N_LAYERS
    # Per block: attention_norm, ffn_norm and MLA's q_norm and kv_norm; then the final norm.
    assert fake_torch_npu.calls["npu_rms_norm"] == 4 * N_LAYERS + 1
    assert fake_torch_npu.calls["npu_rotary_mul"] == 2 * N_LAYERS  # the query's RoPE slice, the shared key
    ref_logits, ref_grads = forward_backward("reference")
    torch.testing.assert_close(npu_logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert npu_grads.keys() == ref_grads.keys()
    for name, grad in npu_grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_under_autocast_no_kernel_call_mixes_the_norm_weights_dtype_with_the_activations(fake_torch_npu):
    # bf16 autocast: the latents (wq_a / wkv_a outputs) are bf16 beside fp32 norm weights; npu_rms_norm requires
    # gamma in the input's dtype and the fake refuses any call that mixes them.
    cfg = load_config(CONFIG, ["--model.dim", "64", "--model.n_layers", "1", "--model.max_seq_len", "16"])
    model = build_model(build_model_args(cfg.model))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    set_kernels("npu")
    fake_torch_npu.calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    logits.float().sum().backward()
    assert fake_torch_npu.calls["npu_rms_norm"] == 5  # attention_norm, q_norm, kv_norm, ffn_norm, the final norm
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for n, p in model.named_parameters()
               if n.endswith(("q_norm.weight", "kv_norm.weight")))


def test_the_published_rope_slice_and_shared_key_are_inside_npu_rotary_muls_limits(fake_torch_npu):
    from titan_npu import ops
    from titan_npu.ops import reference

    # DeepSeek-V3's shapes: 128 heads of 192 (128 no-RoPE + 64 RoPE channels), the RoPE key [B, S, 1, 64].
    set_kernels("npu")
    angles = torch.outer(torch.arange(16).float(), torch.rand(32, generator=torch.Generator().manual_seed(0)))
    cos, sin = angles.cos(), angles.sin()
    for batch, kernel_calls in ((7, 2), (8, 0)):  # B x N = 896 < 1000; 1024 takes the reference
        q = torch.randn(batch, 16, 128, 192)
        k = torch.randn(batch, 16, 1, 64)
        fake_torch_npu.calls.clear()
        q_rope, k_rope = ops.apply_rotary_emb(q[..., 128:], k, cos, sin)
        assert fake_torch_npu.calls["npu_rotary_mul"] == kernel_calls
        ref_q, ref_k = reference.apply_rotary_emb(q[..., 128:], k, cos, sin)
        torch.testing.assert_close(q_rope, ref_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_rope, ref_k, atol=1e-5, rtol=1e-5)

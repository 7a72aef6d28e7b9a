"""DeepSeek-V3's multi-head latent attention on the (fake) NPU kernels: npu_fusion_attention on q/k of head dim
qk_nope + qk_rope and the value zero-padded to it, npu_rms_norm on the low-rank latents, npu_rotary_mul on the
RoPE slices of the query ([B, S, H, rope]) and on the key shared by the heads ([B, S, 1, rope]); the forward and
backward equal the reference kernels'."""

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

"""DeepSeek Sparse Attention on the (fake) NPU kernels: npu_lightning_indexer selects the keys the reference indexer
selects (-1 after the last key a query sees), npu_sparse_flash_attention with npu_sparse_flash_attention_grad gives
the reference's forward and gradients over them, the cases the kernels cannot express take the reference (logged
once), and the fake refuses what the API reference rules out."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from op_compare import assert_same_forward_and_backward

from titan_npu.models.deepseek_v32.args import DSAArgs
from titan_npu.models.deepseek_v32.model import DSATransformer
from titan_npu.ops import npu as npu_ops
from titan_npu.ops import reference, set_kernels
from titan_npu.ops.documents import Documents

BF16_TOL = 2e-2  # bf16 operands: the kernel's output and gradients are rounded to bf16


def indexer_inputs(batch: int, seq: int, heads: int = 4, head_dim: int = 16, seed: int = 0):
    """bf16 q [B, S, H, D] and k [B, S, D], and fp32 weights [B, S, H] that bf16 holds exactly (the kernel takes
    them in q's dtype)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=g).bfloat16()
    k = torch.randn(batch, seq, head_dim, generator=g).bfloat16()
    weights = torch.randn(batch, seq, heads, generator=g).bfloat16().float()
    return q, k, weights


@pytest.fixture
def npu_log(caplog):
    caplog.set_level(logging.INFO, logger="titan_npu")
    return caplog


@pytest.mark.parametrize("topk", [8, 64], ids=["topk<seq", "topk>seq"])
def test_the_indexer_kernel_selects_the_reference_keys(fake_torch_npu, topk):
    q, k, weights = indexer_inputs(2, 37)
    fake_torch_npu.calls.clear()
    got = npu_ops.indexer_topk(q, k, weights, topk)
    assert fake_torch_npu.calls["npu_lightning_indexer"] == 1
    want = reference.indexer_topk(q, k, weights, topk)
    assert got.shape == want.shape == (2, 37, topk) and got.dtype == torch.int32
    assert torch.equal(reference.selected_mask(got, 37), reference.selected_mask(want, 37))
    # The early queries see fewer than topk keys: -1 after their last one, in the same places, though the kernel
    # (as the vendor's golden code ranks) lists the keys it masked there.
    assert torch.equal(got < 0, want < 0)
    assert (got[:, 0] >= 0).sum().item() == 2  # query 0 sees key 0 only
    raw = fake_torch_npu.npu_lightning_indexer(q, k.unsqueeze(2), weights.bfloat16(), sparse_count=topk)[0]
    assert (raw[:, 0] >= 0).sum().item() == 2 * min(topk, 37)


def test_fp32_and_document_masks_take_the_reference_indexer_logged_once(fake_torch_npu, npu_log):
    q, k, weights = indexer_inputs(2, 16)
    documents = Documents.from_starts([[5], [9, 12]], 16, reset_positions=True)
    fake_torch_npu.calls.clear()
    for _ in range(2):
        assert torch.equal(npu_ops.indexer_topk(q.float(), k.float(), weights, 4),
                           reference.indexer_topk(q.float(), k.float(), weights, 4))
        assert torch.equal(npu_ops.indexer_topk(q, k, weights, 4, documents),
                           reference.indexer_topk(q, k, weights, 4, documents))
    assert fake_torch_npu.calls["npu_lightning_indexer"] == 0
    lines = [r.getMessage() for r in npu_log.records if r.getMessage().startswith("npu_lightning_indexer")]
    assert len(lines) == 2 and "float32" in lines[0] and "document masks" in lines[1]


def sparse_inputs(batch: int, seq: int, heads: int, head_dim: int, topk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, generator=g).bfloat16() for _ in range(3))
    scores = torch.randn(batch, seq, seq, generator=g)
    indices = reference.top_keys(scores, reference.visible_keys(batch, seq, q.device), topk)
    return q, k, v, indices


def upcast_reference(q, k, v, indices):
    """The reference on the bf16 operands in fp32, rounded to bf16 as the kernel's output is."""
    return reference.sparse_attention(q.float(), k.float(), v.float(), indices).to(q.dtype)


@pytest.mark.parametrize("seq,topk", [(24, 6), (19, 32)], ids=["topk<seq", "topk>seq"])
def test_the_sparse_attention_kernel_matches_the_reference_forward_and_backward(fake_torch_npu, seq, topk):
    q, k, v, indices = sparse_inputs(2, seq, 4, 16, topk)
    fake_torch_npu.calls.clear()
    assert_same_forward_and_backward(npu_ops.sparse_attention, upcast_reference, [q, k, v, indices], tol=BF16_TOL)
    assert fake_torch_npu.calls["npu_sparse_flash_attention"] == 1
    assert fake_torch_npu.calls["npu_sparse_flash_attention_grad"] == 1


def test_fp32_and_an_unequal_value_head_take_the_reference_attention(fake_torch_npu, npu_log):
    q, k, v, indices = sparse_inputs(1, 12, 2, 16, 4)
    fake_torch_npu.calls.clear()
    assert torch.equal(npu_ops.sparse_attention(q.float(), k.float(), v.float(), indices),
                       reference.sparse_attention(q.float(), k.float(), v.float(), indices))
    assert torch.equal(npu_ops.sparse_attention(q, k, v[..., :8], indices),
                       reference.sparse_attention(q, k, v[..., :8], indices))
    assert fake_torch_npu.calls["npu_sparse_flash_attention"] == 0
    assert len([r for r in npu_log.records if r.getMessage().startswith("npu_sparse_flash_attention")]) == 2


def test_a_layout_the_attention_kernel_refuses_takes_the_reference_from_then_on(fake_torch_npu, npu_log,
                                                                                monkeypatch):
    # The vendor's golden code runs the absorbed MLA form only: should the card refuse per-head keys, the run goes on.
    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported layout")

    monkeypatch.setitem(sys.modules["npu_wheel"]._kernels, "npu_sparse_flash_attention", refuse)
    q, k, v, indices = sparse_inputs(1, 12, 2, 16, 4)
    for _ in range(2):
        assert torch.equal(npu_ops.sparse_attention(q, k, v, indices), reference.sparse_attention(q, k, v, indices))
    warnings = [r for r in npu_log.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(warnings) == 1 and "unsupported layout" in warnings[0].getMessage()


def test_the_warmup_kl_kernels_give_the_reference_loss_and_indexer_gradients(fake_torch_npu):
    # MLA's per-head q / k (16 no-RoPE + 8 RoPE channels) and an indexer of 4 heads of 16, bf16 as on the card.
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 20, 4, 24, generator=g).bfloat16() for _ in range(2))
    q_index, k_index, weights = indexer_inputs(2, 20, seed=1)
    fake_torch_npu.calls.clear()
    assert_same_forward_and_backward(
        lambda qi, ki, w: npu_ops.indexer_warmup_loss(q, k, qi, ki, w, 8),
        lambda qi, ki, w: reference.indexer_warmup_loss(q.float(), k.float(), qi.float(), ki.float(), w, 8),
        [q_index, k_index, weights], tol=BF16_TOL)
    assert fake_torch_npu.calls["npu_dense_lightning_indexer_softmax_lse"] == 1
    assert fake_torch_npu.calls["npu_dense_lightning_indexer_grad_kl_loss"] == 1
    assert fake_torch_npu.calls["npu_fusion_attention"] == 1  # the main attention's softmax statistics


def test_the_fake_refuses_what_the_api_reference_rules_out(fake_torch_npu):
    q, k, weights = indexer_inputs(1, 8)
    with pytest.raises(RuntimeError, match="sparse_count=2500"):
        fake_torch_npu.npu_lightning_indexer(q, k.unsqueeze(2), weights.bfloat16(), sparse_count=2500)
    with pytest.raises(RuntimeError, match="fp16 or bf16"):
        fake_torch_npu.npu_lightning_indexer(q.float(), k.unsqueeze(2).float(), weights, sparse_count=4)
    q, k, v, indices = sparse_inputs(1, 8, 2, 16, 4)
    per_head = indices.unsqueeze(2).expand(-1, -1, 2, -1).contiguous()
    holed = per_head.clone()
    holed[0, 5, :, 1] = -1  # a key after a -1 in the row
    with pytest.raises(RuntimeError, match="after a -1"):
        fake_torch_npu.npu_sparse_flash_attention(q, k, v, holed, 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        fake_torch_npu.npu_sparse_flash_attention(q, k, v, per_head.long(), 0.25)


# (stage, indexer_loss_weight) -> calls per layer of (npu_lightning_indexer, npu_sparse_flash_attention and its
# grad, the warm-up's KL kernels): frozen indexers select with the kernel; a learning one ranks by the fp32 scores
# its KL loss needs; the dense warm-up attends every key (npu_fusion_attention) and its loss is the KL kernel's.
STAGES = {"sparse-frozen": ("sparse", 0.0, 1, 1, 0), "sparse-learning": ("sparse", 1.0, 0, 1, 0),
          "dense-warmup": ("dense_warmup", 1.0, 0, 0, 1)}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_tiny_deepseek_v32_on_the_npu_kernels_tracks_the_reference(fake_torch_npu, stage):
    dsa_stage, loss_weight, indexer_calls, attention_calls, kl_calls = STAGES[stage]
    args = DSAArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_dim=96, norm_eps=1e-6, rope_theta=10000.0,
                   max_seq_len=32, family="deepseek_v32", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=16, v_head_dim=16, n_experts=4, top_k=2, moe_ffn_dim=32, n_shared_experts=1,
                   first_k_dense=1, index_n_heads=4, index_head_dim=16, index_topk=8, dsa_stage=dsa_stage,
                   indexer_loss_weight=loss_weight)
    torch.manual_seed(0)
    model = DSATransformer(args).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))

    def forward_backward(kernels: str):
        set_kernels(kernels)
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        aux = model.auxiliary_loss()
        (logits.float().square().mean() + (0 if aux is None else aux)).backward()
        return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    fake_torch_npu.calls.clear()
    npu_logits, npu_grads = forward_backward("npu")
    assert fake_torch_npu.calls["npu_lightning_indexer"] == 2 * indexer_calls
    assert fake_torch_npu.calls["npu_sparse_flash_attention"] == 2 * attention_calls
    assert fake_torch_npu.calls["npu_sparse_flash_attention_grad"] == 2 * attention_calls
    assert fake_torch_npu.calls["npu_dense_lightning_indexer_grad_kl_loss"] == 2 * kl_calls
    ref_logits, ref_grads = forward_backward("reference")
    assert npu_grads.keys() == ref_grads.keys()
    # bf16 model, fp32 references inside the kernels: each tensor within 5% of the reference's norm.
    for name, got in [("logits", npu_logits), *npu_grads.items()]:
        want = ref_logits if name == "logits" else ref_grads[name]
        assert (got - want).norm() <= 5e-2 * want.norm(), name

"""The Llama Transformer: meta-device build, initialisation, shapes, pipeline and tensor-parallel conventions."""

import math
import os
import time

import pytest
import torch
import torch.nn.functional as F

from titan_npu.config.schema import ModelConfig
from titan_npu.errors import ConfigError
from titan_npu.models.decoder.model import Attention
from titan_npu.models.llama import LlamaArgs, Transformer, precompute_rope
from titan_npu.models.registry import build_model_args


def _tiny(**overrides) -> LlamaArgs:
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=160, max_seq_len=64,
                  rope_theta=10000.0)
    fields.update(overrides)
    return LlamaArgs(**fields)


def _initialised(args: LlamaArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_parameter_names_are_metas():
    names = set(Transformer(_tiny(n_layers=1)).state_dict())
    assert names == {
        "tok_embeddings.weight", "norm.weight", "output.weight",
        "layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
    }


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc")
def test_70b_builds_and_runs_forward_on_meta_quickly_without_real_memory():
    args = build_model_args(ModelConfig(name="llama3", flavor="70B"))
    rss_before = _rss_bytes()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args)
    logits = model(torch.zeros(2, 256, dtype=torch.long, device="meta"))
    elapsed = time.perf_counter() - start
    assert logits.shape == (2, 256, 128256) and logits.is_meta
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert elapsed < 5.0, f"70B meta build + forward took {elapsed:.1f}s"
    # 70B fp32 weights are 282 GB; anything real would show up as gigabytes here.
    assert _rss_bytes() - rss_before < 256 * 2**20


def test_forward_maps_tokens_to_logits():
    model = _initialised(_tiny())
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256) and logits.dtype == torch.float32


def test_init_weights_is_deterministic_under_the_same_seed():
    a, b, c = _initialised(_tiny(), seed=1), _initialised(_tiny(), seed=1), _initialised(_tiny(), seed=2)
    for key, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[key], atol=0, rtol=0)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_init_weights_uses_the_documented_scales():
    args = _tiny(dim=256, n_heads=4, n_kv_heads=4, n_layers=4, ffn_dim=1024, vocab_size=4096)
    model = _initialised(args)
    assert abs(model.tok_embeddings.weight.std().item() - 0.02) < 0.002
    assert abs(model.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.002
    assert abs(model.layers["3"].feed_forward.w1.weight.std().item() - 0.02) < 0.002
    for i in range(4):  # depth-scaled residual projections
        expected = 0.02 / math.sqrt(2 * (i + 1))
        assert abs(model.layers[str(i)].attention.wo.weight.std().item() - expected) < 0.1 * expected
        assert abs(model.layers[str(i)].feed_forward.w2.weight.std().item() - expected) < 0.1 * expected
    assert abs(model.output.weight.std().item() - 256**-0.5) < 0.1 * 256**-0.5
    assert model.output.weight.abs().max().item() <= 3 * 256**-0.5
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert torch.equal(model.layers["2"].ffn_norm.weight, torch.ones(256))


def test_untrained_model_loss_is_near_log_vocab():
    args = _tiny(vocab_size=512)
    model = _initialised(args, seed=3)
    tokens = torch.randint(0, 512, (4, 64))
    with torch.no_grad():
        loss = F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    # Unit-variance initial logits add about 1/2 nat over a uniform guess.
    assert math.log(512) - 0.1 < loss.item() < math.log(512) + 1.0


def test_rope_buffers_are_recomputed_by_init_weights_and_not_saved():
    args = _tiny(rope_scaling_factor=8.0, rope_theta=500000.0)
    model = _initialised(args)
    cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, 8.0)
    assert torch.equal(model.freqs_cos, cos) and torch.equal(model.freqs_sin, sin)
    assert model.freqs_cos.shape == (64, 8) and model.freqs_cos.dtype == torch.float32
    assert not any("freqs" in key for key in model.state_dict())


def test_init_weights_puts_rope_buffers_on_the_requested_device():
    with torch.device("meta"):
        model = Transformer(_tiny())
    model.to_empty(device="meta")
    model.init_weights(buffer_device=torch.device("cpu"))
    assert model.freqs_cos.device.type == "cpu" and model.freqs_sin.device.type == "cpu"


def test_flash_and_eager_attention_models_agree():
    torch.manual_seed(0)
    flash, eager = _initialised(_tiny(use_flash_attention=True)), _initialised(_tiny(use_flash_attention=False))
    eager.load_state_dict(flash.state_dict())
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(flash(tokens), eager(tokens), atol=1e-5, rtol=1e-5)


def test_longer_sequence_than_max_seq_len_is_a_config_error():
    model = _initialised(_tiny(max_seq_len=16))
    with pytest.raises(ConfigError, match=r"sequence length 17 exceeds model.max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_model_is_causal():
    model = _initialised(_tiny())
    tokens = torch.randint(0, 256, (1, 20))
    changed = tokens.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :12], model(changed)[:, :12], atol=0, rtol=0)


def test_pipeline_stages_compose_to_the_full_model():
    args = _tiny(n_layers=4)
    full = _initialised(args)
    first, last = _initialised(args), _initialised(args)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    # Stage 0 keeps the embedding and layers 0-1; stage 1 keeps layers 2-3, the norm and the output.
    for name in ("2", "3"):
        del first.layers[name]
    first.norm, first.output = None, None
    for name in ("0", "1"):
        del last.layers[name]
    last.tok_embeddings = None
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 9, 64)
        torch.testing.assert_close(last(hidden), full(tokens), atol=1e-6, rtol=1e-6)


def test_attention_runs_with_column_sharded_projections_like_tensor_parallel():
    """Two 'ranks' each hold half the heads (wq/wk/wv rows, wo columns); their outputs sum to the full layer."""
    args = _tiny(n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    full = Attention(args)
    x = torch.randn(2, 10, 64)
    cos, sin = precompute_rope(args.head_dim, 10, args.rope_theta)
    q_rows, kv_rows = 2 * args.head_dim, 1 * args.head_dim
    partial_sum = torch.zeros(2, 10, 64)
    for rank in range(2):
        shard = Attention(args)
        with torch.no_grad():
            shard.wq.weight = torch.nn.Parameter(full.wq.weight[rank * q_rows:(rank + 1) * q_rows])
            shard.wk.weight = torch.nn.Parameter(full.wk.weight[rank * kv_rows:(rank + 1) * kv_rows])
            shard.wv.weight = torch.nn.Parameter(full.wv.weight[rank * kv_rows:(rank + 1) * kv_rows])
            shard.wo.weight = torch.nn.Parameter(full.wo.weight[:, rank * q_rows:(rank + 1) * q_rows])
            partial_sum += shard(x, cos, sin)
    assert shard.n_heads == 4 and shard.n_kv_heads == 2
    with torch.no_grad():
        torch.testing.assert_close(partial_sum, full(x, cos, sin), atol=1e-6, rtol=1e-6)


def test_attention_uses_the_first_rows_of_longer_rope_tables():
    # Under sequence parallelism the blocks' residual input holds S / tp positions while attention sees all S, so
    # attention is given the whole tables and takes the rows of its own sequence length.
    args = _tiny()
    torch.manual_seed(0)
    attention = Attention(args)
    cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        torch.testing.assert_close(attention(x, cos, sin), attention(x, cos[:10], sin[:10]), atol=0, rtol=0)


def test_attention_refuses_a_sequence_longer_than_its_rope_tables():
    args = _tiny(max_seq_len=16)
    cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
    with pytest.raises(ConfigError, match=r"sequence length 17 exceeds model.max_seq_len=16"):
        Attention(args)(torch.randn(1, 17, 64), cos, sin)


def test_backward_reaches_every_parameter():
    model = _initialised(_tiny())
    tokens = torch.randint(0, 256, (2, 12))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


def test_bf16_model_runs_and_tracks_fp32():
    fp32 = _initialised(_tiny())
    bf16 = _initialised(_tiny()).to(torch.bfloat16)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        low, ref = bf16(tokens), fp32(tokens)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=5e-2, rtol=5e-2)

"""Generation: KV-cache decoding equals the full forward, sampling honours T / top-k / top-p, and a trained debug
model writes text that resembles its corpus where a random one writes noise."""

import contextlib
import io
import re
import string
from pathlib import Path

import pytest
import torch

from titan_npu.commands.generate import main
from titan_npu.errors import CheckpointError, ConfigError
from titan_npu.models.llama import LlamaArgs, Transformer
from titan_npu.tools.generate import CachedLlama, banned_token_mask, find_config, generate, sample_next

# fp32 on cpu: cached and uncached paths run the same kernels on the same values, up to summation order.
ATOL = 1e-5


def tiny_model(use_flash: bool = True, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=128, max_seq_len=64,
                     use_flash_attention=use_flash, family="llama3", flavor="test")
    model = Transformer(args)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("use_flash", [True, False])
def test_cached_decoding_equals_the_full_forward(use_flash):
    model = tiny_model(use_flash)
    tokens = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = model(tokens)
    dec = CachedLlama(model, max_len=20, batch_size=2)
    prefix = dec.forward(tokens[:, :12], 0)
    steps = [dec.forward(tokens[:, i : i + 1], i) for i in range(12, 20)]
    cached = torch.cat([prefix, *steps], dim=1)
    torch.testing.assert_close(cached, full, atol=ATOL, rtol=0)


def test_cached_decoding_of_a_moe_model_equals_the_full_forward():
    from titan_npu.models.moe_decoder.args import MoEDecoderArgs
    from titan_npu.models.registry import build_model

    args = MoEDecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=97, ffn_dim=96,
                          max_seq_len=64, qk_norm=True, family="qwen3_moe", n_experts=4, top_k=2, moe_ffn_dim=32,
                          decoder_sparse_step=2)  # layer 0 dense, layer 1 MoE
    model = build_model(args)
    model.init_weights(seed=0)
    model.eval()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    dec = CachedLlama(model, max_len=20, batch_size=2)
    cached = torch.cat([dec.forward(tokens[:, :12], 0), *[dec.forward(tokens[:, i : i + 1], i) for i in range(12, 20)]],
                       dim=1)
    torch.testing.assert_close(cached, full, atol=ATOL, rtol=0)


def test_greedy_generation_equals_argmax_of_repeated_full_forwards():
    model = tiny_model()
    prompt = [5, 17, 42]
    out = generate(model, prompt, max_new_tokens=15, temperature=0.0, top_k=0)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(15):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_generation_stops_at_eos_and_drops_it():
    model = tiny_model()
    first = generate(model, [1, 2, 3], max_new_tokens=6, temperature=0.0)[0]
    again = generate(model, [1, 2, 3], max_new_tokens=6, temperature=0.0, eos_id=first[2])[0]
    assert again == first[:2]


def test_generation_stops_at_max_seq_len():
    model = tiny_model()
    out = generate(model, list(range(60)), max_new_tokens=50, temperature=0.0)[0]
    assert len(out) == 64 - 60 + 1  # positions 60..63 fill the cache, the last logits give one more token


def test_zero_temperature_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    assert sample_next(logits, temperature=0.0).tolist() == [1, 0]


def test_top_k_samples_only_the_k_likeliest():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.9, 2.8, 2.7]]).repeat(500, 1)
    picks = sample_next(logits, temperature=5.0, top_k=2, generator=g)
    assert set(picks.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    picks = sample_next(probs.log().repeat(2000, 1), temperature=1.0, top_p=0.75, generator=g)
    assert set(picks.tolist()) == {0, 1}  # 0.5 < 0.75 so id 1 is needed; 0.5 + 0.3 >= 0.75 so id 2 is not
    share = (picks == 0).float().mean().item()
    assert share == pytest.approx(0.5 / 0.8, abs=0.04)  # renormalised within the kept set


def test_sampling_follows_the_softmax_of_logits_over_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([[1.0, 0.0]]).repeat(4000, 1)
    share = (sample_next(logits, temperature=2.0, generator=g) == 0).float().mean().item()
    assert share == pytest.approx(torch.softmax(torch.tensor([0.5, 0.0]), 0)[0].item(), abs=0.03)


def test_banned_ids_are_never_sampled():
    model = tiny_model()
    banned = banned_token_mask(97, 40, [3], torch.device("cpu"))
    out = generate(model, [1, 2], max_new_tokens=40, temperature=3.0, top_k=0, num_samples=4, banned=banned, seed=0)
    ids = {t for sample in out for t in sample}
    assert ids and max(ids) < 40 and 3 not in ids


def test_config_is_found_beside_a_checkpoint(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "config.toml").write_text("")
    step = tmp_path / "logs" / "checkpoints" / "step-100"
    step.mkdir(parents=True)
    assert find_config(step) == tmp_path / "logs" / "config.toml"
    assert find_config(tmp_path / "logs" / "model.pt") == tmp_path / "logs" / "config.toml"


def test_missing_checkpoint_and_missing_config_are_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        main(["--checkpoint", str(tmp_path / "nope.pt")])
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    ckpt = tmp_path / "a" / "b" / "c" / "model.pt"
    torch.save({}, ckpt)
    with pytest.raises(ConfigError, match="pass --config"):
        main(["--checkpoint", str(ckpt)])


# ----------------------------------------------------------------------------------------- end to end on cpu
COMMON_WORDS = {"the", "of", "to", "a", "and", "is", "in", "for", "that", "be", "it", "this", "are", "with", "as",
                "an", "on", "or", "if", "by", "not", "can", "from", "which", "you", "use", "used", "will", "function",
                "object", "value", "module", "class", "return", "returns", "file", "python", "list", "type", "method"}
PRINTABLE = set(string.printable.encode())


def text_scores(text: str) -> tuple[float, float]:
    """(fraction of printable ASCII characters, fraction of words that are common English/Python-doc words)."""
    data = text.encode("utf-8", errors="replace")
    printable = sum(b in PRINTABLE for b in data) / max(len(data), 1)
    words = re.findall(r"[A-Za-z]+", text.lower())
    common = sum(w in COMMON_WORDS for w in words) / max(len(words), 1)
    return printable, common


def debug_run(tmp_path: Path, steps: int) -> tuple[Path, Path]:
    """Train the debug config shrunk to seconds on the built-in corpus (steps=0: untrained).

    Returns (full .pt state dict, checkpoint.dir holding the DCP checkpoint saved at the last step).
    """
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    log_dir, ckpt_dir = tmp_path / f"run{steps}", tmp_path / f"ckpt{steps}"
    overrides = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                 "--model.max_seq_len", "128", "--training.seq_len", "64", "--training.batch_size", "16",
                 "--training.max_steps", str(max(steps, 1)), "--lr_scheduler.warmup_steps", "10",
                 "--optimizer.lr", "1e-2", "--metrics.log_dir", str(log_dir), "--metrics.log_interval", "1000",
                 "--metrics.report", "false", "--metrics.tensorboard", "false", "--metrics.progress", "lines",
                 "--metrics.peak_tflops", "1.0",
                 "--checkpoint.dir", str(ckpt_dir), "--checkpoint.save_interval", "100000",
                 "--checkpoint.async_save", "false", "--checkpoint.enable", str(steps > 0).lower()]
    cfg = load_config(Path(__file__).parents[2] / "configs" / "debug.toml", overrides)
    trainer = Trainer(cfg)
    try:
        if steps:
            trainer.train()
        torch.save(trainer.model.state_dict(), log_dir / "model.pt")
    finally:
        trainer.close()
    return log_dir / "model.pt", ckpt_dir


def sample_text(ckpt: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--checkpoint", str(ckpt), "--max-new-tokens", "300", "--temperature", "0.8",
                   "--top-k", "0", "--num-samples", "4", "--seed", "0"])
    assert rc == 0
    return out.getvalue()


def test_trained_debug_model_writes_corpus_like_text_and_a_random_one_does_not(tmp_path, one_thread):
    trained_pt, trained_dcp = debug_run(tmp_path, steps=150)
    trained = sample_text(trained_pt)
    assert sample_text(trained_dcp) == trained  # the DCP checkpoint (latest in checkpoint.dir) holds the same model
    random = sample_text(debug_run(tmp_path, steps=0)[0])
    t_print, t_common = text_scores(trained)
    r_print, r_common = text_scores(random)
    # After 150 steps a byte model of the docs emits almost only printable ASCII, and about a quarter of its
    # words are common ones (measured: 0.99 and 0.26); an untrained one spreads over all 256 byte values
    # (measured: 0.32 printable, 0.01-0.02 common words).
    assert t_print > 0.95, trained
    assert r_print < 0.7, random
    assert t_common > 0.12 and t_common > 4 * r_common, (t_common, r_common, trained, random)


def test_a_hybrid_linear_attention_model_is_refused_in_one_line():
    from titan_npu.models.qwen3_next.args import Qwen3NextArgs
    from titan_npu.models.qwen3_next.model import Qwen3NextTransformer

    args = Qwen3NextArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=64, ffn_dim=32,
                         max_seq_len=32, family="qwen3_next", n_experts=0, full_attention_interval=2,
                         linear_n_k_heads=1, linear_n_v_heads=2, linear_k_head_dim=8, linear_v_head_dim=8)
    with pytest.raises(ConfigError, match="no cached decoding for qwen3_next"):
        CachedLlama(Qwen3NextTransformer(args), max_len=16)

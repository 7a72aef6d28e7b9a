"""Helpers the model-family tests share to hold a model to its Hugging Face reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


def randomise(model: torch.nn.Module, seed: int, scale: float = 0.08, norm_scale: float = 0.2) -> None:
    """Weights well away from init, norms (and biases) included, so a wrongly mapped tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + norm_scale * noise if "norm" in name else scale * noise)


def use_reference_kernels() -> Iterator[None]:
    """The reference kernels (the plain torch ops transformers runs) while a test runs: a module installs it with
    `_reference_kernels = pytest.fixture(autouse=True)(use_reference_kernels)`."""
    from titan_npu import ops

    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def hf_model(family: str, args: Any) -> torch.nn.Module:
    """transformers' model of the family's HF config for `args` (eager attention), in eval mode."""
    import transformers

    from titan_npu.models.registry import get_spec

    config = transformers.AutoConfig.for_model(**get_spec(family).hf.config(args), attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def import_hf_model(family: str, hf: torch.nn.Module, args: Any, **from_hf: Any) -> torch.nn.Module:
    """Our model of `args` holding the transformers model's weights, through the family's adapter (`from_hf` its
    keyword arguments)."""
    from titan_npu.models.registry import build_model, get_spec

    ours = build_model(args)
    ours.load_state_dict(get_spec(family).hf.from_hf(hf.state_dict(), args, **from_hf), strict=True)
    return ours


def random_tokens(vocab_size: int, seq_len: int, seed: int, batch: int = 2) -> torch.Tensor:
    """`batch` sequences of `seq_len` random token ids from `seed`."""
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ours or of a transformers model, without gradients."""
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def memorisable_batches(vocab_size: int, seq_len: int, steps: int, seed: int = 8, batch: int = 4
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (inputs, labels) batches drawn from 8 fixed sequences: learnable within a few dozen steps, so a
    training comparison sees losses that move."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, vocab_size, (8, seq_len + 1), generator=gen)
    batches = []
    for _ in range(steps):
        seq = pool[torch.randint(0, 8, (batch,), generator=gen)]
        batches.append((seq[:, :-1], seq[:, 1:]))
    return batches


def adamw_steps(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], lr: float = 3e-3
                ) -> list[float]:
    """One AdamW step (fixed lr, clipping at 1.0, for-loop kernels) per batch on loss_fn(model, inputs, labels);
    the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=False)
    losses = []
    for tokens, labels in batches:
        loss = loss_fn(model, tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# A tiny train.py run on the byte tokenizer (vocab 512), seq 32: the CLI tests' settings.
TINY_TRAIN_ARGS = ["--training.seq_len", "32", "--training.batch_size", "2", "--training.dtype", "fp32",
                   "--training.deterministic", "true", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
                   "--data.tokenizer", "byte", "--data.num_workers", "0", "--metrics.log_interval", "1",
                   "--metrics.tensorboard", "false", "--metrics.report", "false", "--metrics.progress", "lines",
                   "--checkpoint.async_save", "false"]
ROOT = Path(__file__).resolve().parents[2]


def run_python(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python *argv` with this checkout's package first on the path, as a user runs it from a clone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def train_from_the_import(printed: str, tmp_path: Path, steps: int, initial_load: Path | None = None
                          ) -> tuple[str, list[dict]]:
    """The [model] lines `titan-npu import` printed, as a user pastes them, in tmp_path/run.toml with a run that
    starts from `initial_load` (default: the HF directory tmp_path/hf itself; checkpoints in tmp_path/ckpt);
    train.py's tiny run of `steps` steps on it: its output and its training records."""
    model_lines = printed[printed.index("[model]"):printed.index("[checkpoint]")]
    initial_load = initial_load or tmp_path / "hf"
    (tmp_path / "run.toml").write_text(model_lines + f'\n[checkpoint]\ninitial_load = "{initial_load}"\n'
                                       f'dir = "{tmp_path / "ckpt"}"\n\n[metrics]\nlog_dir = "{tmp_path / "logs"}"\n')
    trained = run_python(str(ROOT / "train.py"), "--config", str(tmp_path / "run.toml"), *TINY_TRAIN_ARGS,
                         "--training.max_steps", str(steps), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return trained.stderr + trained.stdout, [r for r in records if "loss" in r]


def first_batch(tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (inputs, labels) the trainer's loader yields for tmp_path/run.toml with the tiny run's settings."""
    from titan_npu.config.loader import load_config
    from titan_npu.data import build_dataloader, build_tokenizer

    cfg = load_config(tmp_path / "run.toml", TINY_TRAIN_ARGS)
    return next(iter(build_dataloader(cfg, build_tokenizer(cfg.data.tokenizer), 0, 1)))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The mean cross entropy of (batch, seq, vocab) logits against (batch, seq) labels, in fp32."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()


def first_step_is_the_references(hf: torch.nn.Module, record: dict, tmp_path: Path, rtol: float = 1e-5,
                                  aux: bool = False) -> None:
    """The step-1 record of the run in tmp_path logs `hf`'s cross entropy on the run's own first batch (the same
    tokens the loader gives first) to rtol, and with aux, transformers' aux loss (MoE) to 1e-5."""
    inputs, labels = first_batch(tmp_path)
    with torch.no_grad():
        out = hf(inputs, output_router_logits=True) if aux else hf(inputs)
    ce = cross_entropy(out.logits, labels)
    assert abs(record["loss"] - ce) <= rtol * ce, (record["loss"], ce)  # the imported model's cross entropy
    if aux:
        assert abs(record["aux_loss"] - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()


def save_hf_dir(state: dict[str, torch.Tensor], config: dict, path: Path) -> None:
    """A Hugging Face directory at `path` (new): `state` as model.safetensors and `config` as config.json."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def round_trip_hf_dir(hf: torch.nn.Module, family: str, tmp_path: Path) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """`hf` saved by save_pretrained to tmp_path/hf, which must name `family` by its model_type; our model built from
    what read_weights reads there; exported back through the family's conversion to tmp_path/back and loaded by
    transformers' Auto class (eager attention). Returns (the weights read, ours, the model loaded back)."""
    import transformers

    from titan_npu.checkpoint.formats import read_weights
    from titan_npu.models.registry import build_model, get_spec, spec_for_hf_config

    hf.save_pretrained(tmp_path / "hf")
    assert spec_for_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text())).name == family
    weights = read_weights(tmp_path / "hf")
    ours = build_model(weights.args)
    ours.load_state_dict(weights.state_dict, strict=True)
    spec = get_spec(family)
    save_hf_dir(spec.hf.to_hf(ours.state_dict(), weights.args), spec.hf.config(weights.args), tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    return weights, ours, back


def export_and_compare(tmp_path: Path, ours: torch.nn.Module) -> torch.nn.Module:
    """`titan-npu export --format hf` of tmp_path/ckpt's latest checkpoint to tmp_path/out, loaded by transformers:
    it must give `ours` (the model holding that checkpoint) logits within 1e-5; the loaded model."""
    import transformers

    from titan_npu.cli import main

    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--dtype", "fp32",
                 "--output", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.arange(64).remainder(ours.args.vocab_size).reshape(2, 32)
    with torch.no_grad():
        assert (back(tokens).logits - ours(tokens)).abs().max().item() < 1e-5
    return back

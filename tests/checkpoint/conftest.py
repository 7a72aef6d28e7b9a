"""Shared helpers of the checkpoint tests: tiny models, a single-process manager, free ports, tiny runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titan_npu import ops
from titan_npu.checkpoint import storage
from titan_npu.checkpoint.manager import CheckpointManager
from titan_npu.config.schema import JobConfig
from titan_npu.models.llama import LlamaArgs, Transformer

# Tiny shapes: Llama 2 style multi-head attention, and Llama 3 style grouped-query attention.
TINY = {
    "llama2-mha": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=160, ffn_dim=128,
                            norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64, family="llama2"),
    "llama3-gqa": LlamaArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=160, ffn_dim=160,
                            norm_eps=1e-5, rope_theta=500000.0, max_seq_len=64, family="llama3"),
}


@pytest.fixture(autouse=True)
def _reference_kernels():
    ops.set_kernels("reference")
    yield
    ops.set_kernels("auto")


def random_model(args: LlamaArgs, seed: int) -> Transformer:
    """A model with weights well away from init (norms included), so a misplaced tensor shows in the logits."""
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.08 * noise)
    return model


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def tokens_for(args: LlamaArgs, seed: int = 0, seq_len: int = 24) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))


def fake_checkpoint(root: Path, step: int) -> Path:
    """A directory that counts as the complete checkpoint step-`step` (empty DCP metadata, minimal info)."""
    path = root / storage.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / storage.DCP_METADATA).write_bytes(b"")
    (path / storage.INFO_FILE).write_text(f'{{"format": "{storage.FORMAT_NAME}", "step": {step}}}')
    return path


def job_config(tmp_path: Path, **checkpoint) -> JobConfig:
    cfg = JobConfig()
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.metrics.log_dir = str(tmp_path / "logs")
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def model_manager(cfg: JobConfig, model: torch.nn.Module, args: LlamaArgs, lr: float = 1e-2):
    """A manager around a bare model with AdamW and a LambdaLR, as the trainer builds them (single process)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    state = SimpleNamespace(step=0, tokens_seen=0)
    manager = CheckpointManager(cfg, [model], optimizer, scheduler, None, state, model_args=args)
    return manager, optimizer, scheduler, state


def train_steps(model, optimizer, scheduler, state, tokens: torch.Tensor, n: int) -> list[float]:
    """n plain steps of next-token loss on fixed tokens; returns the losses."""
    losses = []
    for _ in range(n):
        out = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += tokens.numel()
        losses.append(loss.item())
    return losses

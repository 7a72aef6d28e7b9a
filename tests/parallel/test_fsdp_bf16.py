"""bf16 FSDP computes what one process computes: the fp32 RoPE tables reach every block unrounded.

FSDP's mixed-precision policy casts a unit's floating-point forward inputs to the parameter dtype; the blocks take
the RoPE tables as inputs, so that cast would rotate q/k by bf16-rounded cos/sin (errors up to 2^-9) where one
process rotates by the fp32 tables. Two gloo ranks run the forward of the same batch under FSDP(2) in bf16.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks

from titan_npu.config.loader import load_config
from titan_npu.models.llama import Transformer
from titan_npu.models.registry import build_model_args, spec_of
from titan_npu.parallel.process_group import free_port

LLAMA3 = ["--model.name=llama3", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
          "--model.vocab_size=256", "--model.max_seq_len=128", "--model.rope_theta=10000"]
# Qwen3 at the same size: q/k norms (in bf16 under FSDP), head size 32, the output tied to the embedding.
MODELS = {"llama3": LLAMA3,
          "qwen3": [*LLAMA3, "--model.name=qwen3", "--model.head_dim=32", "--model.ffn_dim=128"]}
SEQ = 128


def _model_and_batch(cfg) -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(build_model_args(cfg.model))
    model.init_weights()
    return model, torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _fsdp_worker(rank: int, world: int, port: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from titan_npu.parallel import ParallelDims

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, model_args in MODELS.items():  # one process group for every model
            cfg = load_config(None, [*model_args, "--training.dtype=bf16"])
            dims = ParallelDims.from_config(cfg.parallel, world)
            dims.build_mesh("cpu")
            model, tokens = _model_and_batch(cfg)
            table_dtypes: set[torch.dtype] = set()
            for block in model.layers.values():
                block.register_forward_pre_hook(
                    lambda mod, args, seen=table_dtypes: seen.update(a.dtype for a in args[1:]))
            model = spec_of(model.args).parallelize(model, dims, cfg)
            with torch.no_grad():
                logits = model(tokens)
            if rank == 0:
                torch.save({"logits": logits.float(), "table_dtypes": sorted(map(str, table_dtypes))},
                           out / f"{name}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_logits(tmp_path_factory) -> Path:
    """The first logits of every model of MODELS under bf16 FSDP(2), in <model>.pt (one pool of two ranks)."""
    out = tmp_path_factory.mktemp("fsdp_bf16")
    spawn_ranks(_fsdp_worker, (2, free_port(), out), 2)
    return out


@pytest.mark.parametrize("model_name", list(MODELS))
def test_bf16_fsdp_first_logits_equal_one_process_within_bf16_tolerance(fsdp_logits, model_name):
    fsdp = torch.load(fsdp_logits / f"{model_name}.pt")
    assert fsdp["table_dtypes"] == ["torch.float32"]  # what the blocks receive, after FSDP's input cast

    cfg = load_config(None, [*MODELS[model_name], "--training.dtype=bf16"])
    model, tokens = _model_and_batch(cfg)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(tokens).float()
    # One process in pure bf16 rounds the weights once, as FSDP's bf16 all-gather does, and keeps the tables fp32.
    tables = model.freqs_cos, model.freqs_sin
    model.to(torch.bfloat16)
    model.freqs_cos, model.freqs_sin = tables
    with torch.no_grad():
        pure = model(tokens).float()
    # The same arithmetic as pure bf16: equal up to the order of fp32 sums inside the kernels.
    torch.testing.assert_close(fsdp["logits"], pure, atol=1e-3, rtol=0)
    # And the mixed-precision run (fp32 residual stream, weights rounded per matmul): logits of size up to 5 within
    # 4 bf16 ulps at that size (2^-4; measured 2^-5).
    torch.testing.assert_close(fsdp["logits"], mixed, atol=2**-4, rtol=0)

"""Two gloo ranks (FSDP): the logged loss is the mean over data-parallel ranks, throughput is global and per
device, validation sums over ranks, and only rank 0 writes."""

import json
import os
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks

from titan_npu.parallel.process_group import free_port

STEPS, BATCH, SEQ = 4, 2, 32


def worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)
    from titan_npu.config.loader import load_config
    from titan_npu.trainer import Trainer

    overrides = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                 "--model.max_seq_len", "64", "--training.seq_len", str(SEQ), "--training.batch_size", str(BATCH),
                 "--training.max_steps", str(STEPS), "--metrics.log_dir", f"{tmp}/logs", "--metrics.log_interval",
                 "2", "--metrics.tensorboard", "false", "--metrics.progress", "lines", "--metrics.report", "false",
                 "--metrics.peak_tflops", "1.0", "--checkpoint.enable", "false", "--checkpoint.dir", f"{tmp}/ckpt",
                 "--validation.enable", "true", "--validation.interval", str(STEPS), "--validation.steps", "2",
                 "--data.val_fraction", "0.05", "--parallel.dp_shard", "2"]
    cfg = load_config(Path(__file__).parents[2] / "configs" / "debug.toml", overrides)
    trainer = Trainer(cfg)
    local: list[float] = []
    train_step = trainer.train_step

    def recording_step(data_iter):
        loss, grad_norm, data_time = train_step(data_iter)
        local.append(float(loss))  # this rank's own loss (a host sync: fine in a test)
        return loss, grad_norm, data_time

    trainer.train_step = recording_step
    try:
        trainer.train()
    finally:
        trainer.close()
    Path(f"{tmp}/local{rank}.json").write_text(json.dumps(local))


@pytest.mark.distributed
def test_two_ranks_log_dp_mean_loss_and_global_throughput(tmp_path):
    spawn_ranks(worker, (2, free_port(), str(tmp_path)), 2)
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 4]  # written once (rank 0), not once per rank
    local = [json.loads((tmp_path / f"local{r}.json").read_text()) for r in (0, 1)]
    assert local[0] != local[1]  # the ranks read different data
    for r in train:
        i = r["step"] - 1
        assert r["loss"] == pytest.approx((local[0][i] + local[1][i]) / 2, rel=1e-6)
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["tokens_seen"] == r["step"] * 2 * BATCH * SEQ
    assert [(v["step"], v["val_batches"], v["val_tokens"]) for v in val] == [(STEPS, 2, 2 * 2 * BATCH * SEQ)]
    assert json.loads((tmp_path / "logs" / "run_info.json").read_text())["layout"].startswith("world=2")


def tp_worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)
    from titan_npu.checkpoint.initial_load import load_initial_weights
    from titan_npu.config.loader import load_config
    from titan_npu.data import build_tokenizer
    from titan_npu.device import setup_device
    from titan_npu.models.llama import Transformer
    from titan_npu.models.registry import build_model_args, spec_of
    from titan_npu.parallel import ParallelDims, destroy_process_group, init_process_group
    from titan_npu.parallel.parallelize import materialize
    from titan_npu.parallel.reduce import loss_parallel_context
    from titan_npu.trainer.validate import Validator

    cfg = load_config(Path(__file__).parents[2] / "configs" / "debug.toml",
                      ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads",
                       "2", "--model.max_seq_len", "64", "--training.seq_len", str(SEQ), "--training.batch_size",
                       str(BATCH), "--data.val_fraction", "0.05", "--validation.steps", "2",
                       "--parallel.tp_degree", "2", "--parallel.dp_shard", "1", "--parallel.loss_parallel", "true"])
    device = setup_device()
    init_process_group(device, cfg.comm)
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.build_mesh("cpu", cfg.comm.timeout_s)
    args = build_model_args(cfg.model)
    with torch.device("meta"):
        model = Transformer(args)
    model = spec_of(model.args).parallelize(model, dims, cfg)
    materialize(model, device.torch_device, cfg)
    load_initial_weights(model, f"{tmp}/weights.pt", args)
    v = Validator(cfg, build_tokenizer("byte"), 0, 1, device, args.vocab_size, dims.mesh["dp"].get_group())
    record = v.run(model, 1, loss_context=lambda: loss_parallel_context(dims, True))
    if rank == 0:
        Path(f"{tmp}/tp.json").write_text(json.dumps(record))
    destroy_process_group()


@pytest.mark.distributed
def test_validation_with_vocab_sharded_logits_matches_one_process(tmp_path):
    from titan_npu.config.loader import load_config
    from titan_npu.data import build_tokenizer
    from titan_npu.device import setup_device
    from titan_npu.models.llama import Transformer
    from titan_npu.models.registry import build_model_args
    from titan_npu.trainer.validate import Validator

    cfg = load_config(Path(__file__).parents[2] / "configs" / "debug.toml",
                      ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads",
                       "2", "--model.max_seq_len", "64", "--training.seq_len", str(SEQ), "--training.batch_size",
                       str(BATCH), "--data.val_fraction", "0.05", "--validation.steps", "2"])
    args = build_model_args(cfg.model)
    torch.manual_seed(3)
    model = Transformer(args)
    model.init_weights()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    reference = Validator(cfg, build_tokenizer("byte"), 0, 1, setup_device(), args.vocab_size).run(model, 1)

    spawn_ranks(tp_worker, (2, free_port(), str(tmp_path)), 2)
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["val_tokens"] == reference["val_tokens"] == 2 * BATCH * SEQ
    # Same weights and batches; TP only reorders the matmul sums (fp32).
    assert tp["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)

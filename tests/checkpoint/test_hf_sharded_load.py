"""checkpoint.initial_load of a safetensors Hugging Face directory reads only each rank's slices.

Tiny Qwen3 (q/k norms, untied, several files with an index), Qwen2.5 (q/k/v biases, tied, bf16 on disk) and
Qwen3-MoE (one HF tensor per expert, stacked in ours: a rank reads only its experts) models are saved with
transformers' save_pretrained, then loaded by 2 and 4 gloo ranks under FSDP, TP and FSDP x TP. The gathered weights
equal the full read's (read_weights: every tensor of every file) bit for bit, and a hook around the slice reader
shows that each rank read exactly its shard's elements, q/k rows rounded out to whole heads, and never a whole file.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks

from titan_npu.checkpoint import hf_slices
from titan_npu.checkpoint.formats import read_weights
from titan_npu.checkpoint.initial_load import load_initial_weights
from titan_npu.errors import CheckpointError
from titan_npu.models.decoder.args import DecoderArgs
from titan_npu.models.init import local_indices
from titan_npu.models.moe_decoder.args import MoEDecoderArgs
from titan_npu.models.registry import get_spec
from titan_npu.parallel.process_group import free_port

transformers = pytest.importorskip("transformers")

# head_dim 16: 4 query heads of 16 rows, 2 key/value heads (q/k heads split across 2 tensor-parallel ranks); vocab
# 162 cuts unevenly over 4 ranks.
_SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=162, ffn_dim=96, norm_eps=1e-6,
              rope_theta=1000000.0, max_seq_len=64)
MODELS = {
    "qwen3": DecoderArgs(**_SHAPE, qk_norm=True, family="qwen3"),
    "qwen2": DecoderArgs(**_SHAPE, qkv_bias=True, tie_embeddings=True, family="qwen2"),
    "qwen3_moe": MoEDecoderArgs(**_SHAPE, qk_norm=True, family="qwen3_moe", n_experts=4, top_k=2, moe_ffn_dim=32),
}
# (case, model, parallel overrides)
TWO_RANKS = [
    ("qwen3_fsdp", "qwen3", ["--parallel.dp_shard=2"]),
    ("qwen3_tp", "qwen3", ["--parallel.dp_shard=1", "--parallel.tp_degree=2"]),
    ("qwen2_tp", "qwen2", ["--parallel.dp_shard=1", "--parallel.tp_degree=2"]),
    # Activation checkpointing puts a wrapper's name into the parameters' names.
    ("qwen2_fsdp_ac", "qwen2", ["--parallel.dp_shard=2", "--activation_checkpoint.mode=full"]),
    ("qwen3_pp", "qwen3", ["--parallel.dp_shard=1", "--parallel.pp_degree=2"]),
    # FSDP cuts the 4 stacked experts 2 and 2.
    ("qwen3_moe_fsdp", "qwen3_moe", ["--parallel.dp_shard=2"]),
    # Expert parallelism: each rank holds 2 of the 4 experts whole and reads only those.
    ("qwen3_moe_ep", "qwen3_moe", ["--parallel.dp_shard=2", "--parallel.ep_degree=2"]),
]
FOUR_RANKS = [
    ("qwen3_fsdp2_tp2", "qwen3", ["--parallel.dp_shard=2", "--parallel.tp_degree=2"]),
    # 32 key rows over 4 ranks: 8 each, half a head, so each rank reads its whole head.
    ("qwen2_fsdp4", "qwen2", ["--parallel.dp_shard=4"]),
]


def _save_hf(args: DecoderArgs, out: Path, seed: int, dtype: torch.dtype, max_shard_size: str) -> None:
    """A transformers model of `args`, weights well away from init (norms and biases included), saved to `out`."""
    config = transformers.AutoConfig.for_model(**get_spec(args.family).hf.config(args))
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.08 * noise)
    model.to(dtype).save_pretrained(out, max_shard_size=max_shard_size)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """qwen3: fp32 in several files with an index; qwen2: bf16 (the model's fp32 parameters are cast), one file."""
    root = tmp_path_factory.mktemp("hf")
    _save_hf(MODELS["qwen3"], root / "qwen3", seed=1, dtype=torch.float32, max_shard_size="60KB")
    _save_hf(MODELS["qwen2"], root / "qwen2", seed=2, dtype=torch.bfloat16, max_shard_size="50MB")
    _save_hf(MODELS["qwen3_moe"], root / "qwen3_moe", seed=3, dtype=torch.float32, max_shard_size="60KB")
    assert (root / "qwen3" / "model.safetensors.index.json").is_file()
    assert len(list((root / "qwen3").glob("*.safetensors"))) > 2
    return {name: root / name for name in MODELS}


# ---------------------------------------------------------------- what each rank does


def _expected_elements(name: str, param: torch.Tensor, block: int) -> int:
    """The elements a rank must read of `param`: its shard, with rows rounded out to whole `block`s."""
    indices = local_indices(param)
    rows = len({int(i) // block for i in indices[0]}) * block if len(indices[0]) else 0
    for ix in indices[1:]:
        rows *= len(ix)
    return rows


def _load_case(workdir: Path, case: str, model: str, overrides: list[str], hf_dir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from titan_npu.checkpoint.formats import hf_model
    from titan_npu.config.loader import load_config
    from titan_npu.models.init import canonical_name
    from titan_npu.parallel import ParallelDims
    from titan_npu.parallel.parallelize import build_model_parts

    cfg = load_config(None, overrides)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.build_mesh("cpu")
    spec, args, _ = hf_model(hf_dir)
    _, parts = build_model_parts(spec, cfg, dims, args, torch.device("cpu"))

    reads: list[tuple[str, int, int]] = []
    real_read_block = hf_slices.read_block

    def counting_read_block(handle, key, index):
        values = real_read_block(handle, key, index)
        reads.append((key, values.numel(), values.numel() * values.element_size()))
        return values

    def no_full_read(*_args, **_kwargs):
        raise AssertionError("a whole safetensors file was read")

    import safetensors.torch

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("titan_npu")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    real_load_file = safetensors.torch.load_file
    hf_slices.read_block, safetensors.torch.load_file = counting_read_block, no_full_read
    try:
        load_initial_weights(parts, hf_dir, args)
    finally:
        hf_slices.read_block, safetensors.torch.load_file = real_read_block, real_load_file
        logger.removeHandler(handler)

    expected = {}
    for part in parts:
        held = {id(p): (canonical_name(n), p) for n, p in part.named_parameters(remove_duplicate=False)}
        for name, param in held.values():
            source = "tok_embeddings.weight" if name == "output.weight" and args.tie_embeddings else name
            stacked = spec.hf.stacked_names(source, args)
            if stacked is not None:  # one HF tensor per index of dim 0: the rank's slice of each it holds
                indices = local_indices(param)
                for index in indices[0].tolist():
                    expected[stacked[index]] = len(indices[1]) * len(indices[2])
                continue
            key = spec.hf.hf_name(source)
            expected[key] = expected.get(key, 0) + _expected_elements(name, param, spec.hf.permuted_block(name, args))
    weights = {}
    for part in parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: v.detach().clone() for k, v in full.items()})
    torch.save({"reads": reads, "expected": expected, "weights": weights, "log": records},
               workdir / f"{case}.rank{rank}.pt")


def _worker(rank: int, world: int, port: int, workdir: Path, cases: list) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TITAN_DEVICE="cpu")
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in cases:
            case()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def loads(hf_dirs, tmp_path_factory) -> Path:
    """Every case loaded: one 2-rank and one 4-rank process group, each running its cases one after another."""
    workdir = tmp_path_factory.mktemp("loads")
    for world, cases in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        jobs = [partial(_load_case, workdir, case, model, overrides, hf_dirs[model])
                for case, model, overrides in cases]
        spawn_ranks(_worker, (world, free_port(), workdir, jobs), world)
    return workdir


def _ranks(workdir: Path, case: str) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in sorted(workdir.glob(f"{case}.rank*.pt"))]


# ---------------------------------------------------------------- the specifications


@pytest.mark.parametrize("case, model, overrides", TWO_RANKS + FOUR_RANKS, ids=[c[0] for c in TWO_RANKS + FOUR_RANKS])
def test_each_rank_gets_the_full_reads_weights_bit_for_bit(loads, hf_dirs, case, model, overrides):
    reference = read_weights(hf_dirs[model]).state_dict
    loaded = set()
    for rank, result in enumerate(_ranks(loads, case)):
        for key, value in result["weights"].items():
            assert value.dtype == torch.float32, key
            assert torch.equal(value, reference[key].to(torch.float32)), f"rank {rank}: {key}"
        loaded |= set(result["weights"])
    assert loaded == set(reference)  # a pipeline stage holds its layers only; together they hold all


@pytest.mark.parametrize("case, model, overrides", TWO_RANKS + FOUR_RANKS, ids=[c[0] for c in TWO_RANKS + FOUR_RANKS])
def test_each_rank_reads_its_shard_rounded_to_whole_heads_not_the_files(loads, hf_dirs, case, model, overrides):
    files = sum(f.stat().st_size for f in hf_dirs[model].glob("*.safetensors"))
    ranks = _ranks(loads, case)
    for rank, result in enumerate(ranks):
        per_key: dict[str, int] = {}
        for key, elements, _ in result["reads"]:
            per_key[key] = per_key.get(key, 0) + elements
        assert per_key == {k: v for k, v in result["expected"].items() if v}, f"rank {rank}"
        read = sum(nbytes for *_, nbytes in result["reads"])
        assert read < 0.75 * files, f"rank {rank} read {read} of {files} bytes"
        assert f"initial_load: this rank read {read} of the {files} bytes of {hf_dirs[model]}" in result["log"]
    summary = [line for line in ranks[0]["log"] if "shard-wise" in line]
    assert len(summary) == 1 and f"over {len(ranks)} ranks" in summary[0], ranks[0]["log"]


def test_a_shard_cut_inside_a_head_reads_that_whole_head(loads):
    # FSDP over 4 ranks cuts each of the 2 key heads (16 rows) in two: every rank reads 16 rows for its 8.
    for result in _ranks(loads, "qwen2_fsdp4"):
        read = {key: elements for key, elements, _ in result["reads"]}
        assert read["model.layers.0.self_attn.k_proj.weight"] == 16 * 64
        assert read["model.layers.0.self_attn.k_proj.bias"] == 16


# ---------------------------------------------------------------- one process


def test_a_single_process_load_equals_the_full_read_and_reads_each_tensor_once(hf_dirs, monkeypatch):
    reads = []
    real = hf_slices.read_block
    monkeypatch.setattr(hf_slices, "read_block", lambda h, key, index: reads.append(key) or real(h, key, index))
    model = get_spec("qwen3").build_model(MODELS["qwen3"])
    load_initial_weights(model, hf_dirs["qwen3"], MODELS["qwen3"])
    reference = read_weights(hf_dirs["qwen3"]).state_dict
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key]), key
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(reference)


def test_the_summary_states_min_max_and_total_per_rank_against_the_full_size():
    line = hf_slices.read_volume_line([3 * 2**29, 3 * 2**30], 140 * 2**30, Path("/m"))
    assert line == ("initial_load: read /m shard-wise: 1.5 GiB to 3.0 GiB per rank (4.5 GiB over 2 ranks); the full "
                    "weights are 140.0 GiB, 280.0 GiB if every rank read them")
    assert "1023 B to 1.0 KiB per rank" in hf_slices.read_volume_line([1023, 1024], 2048, Path("/m"))


def test_whole_heads_of_a_permuted_tensor_take_the_rows_of_the_whole_tensor_in_our_layout():
    args, adapter = MODELS["qwen3"], get_spec("qwen3").hf
    name = "layers.1.attention.wk.weight"
    whole = torch.randn(args.n_kv_heads * args.head_dim, args.dim)
    ours = adapter.from_hf_layout(name, whole, args)
    assert not torch.equal(ours, whole)
    head = slice(args.head_dim, 2 * args.head_dim)
    assert torch.equal(adapter.from_hf_layout(name, whole[head, 8:40], args), ours[head, 8:40])
    with pytest.raises(CheckpointError, match=r"has shape \(8, 64\) but the model expects \(32, 64\) \(or whole "
                                              r"heads of its rows\)"):
        adapter.from_hf_layout(name, whole[:8], args)


def test_other_heads_than_the_model_are_refused_before_anything_is_read(hf_dirs, monkeypatch):
    monkeypatch.setattr(hf_slices, "read_block", lambda *a: pytest.fail("read before the check"))
    other = DecoderArgs(**{**_SHAPE, "n_heads": 2, "head_dim": 32}, qk_norm=True, family="qwen3")
    with pytest.raises(CheckpointError, match=r"trained with other attention heads than \[model\] \(n_heads 4 vs 2"):
        load_initial_weights(get_spec("qwen3").build_model(other), hf_dirs["qwen3"], other)


def test_a_model_of_another_size_is_refused_naming_the_shapes(hf_dirs):
    bigger = DecoderArgs(**{**_SHAPE, "ffn_dim": 128}, qk_norm=True, family="qwen3")
    with pytest.raises(CheckpointError, match=r"does not fit the model: 6 shape mismatch\(es\) \(e.g. "
                                              r"layers.0.feed_forward.w1.weight: checkpoint \(96, 64\) vs model "
                                              r"\(128, 64\).* likely the checkpoint is for another model size"):
        load_initial_weights(get_spec("qwen3").build_model(bigger), hf_dirs["qwen3"], bigger)

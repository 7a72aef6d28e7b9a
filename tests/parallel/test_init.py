"""Layout-independent initialisation (models/init.py): a shard drawn on its own equals the same slice of the whole
parameter for every placement the layouts use, a rank draws only the tiles overlapping its shard, and pipeline
stages, wrappers and parameter dtypes do not change the values. The gathered weights of real multi-rank layouts
are compared with one process's in test_loss_parity.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_npu.config.schema import ActivationCheckpointConfig, ModelConfig
from titan_npu.models import init
from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.llama import Transformer
from titan_npu.models.registry import build_model_args
from titan_npu.parallel.activation_checkpoint import apply_activation_checkpointing

ARGS = build_model_args(ModelConfig(name="llama3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
                                    max_seq_len=32))
# Qwen3 at the same size (q/k norms, head size 32): tied, and untied as pipeline parallelism runs it.
QWEN3_ARGS = build_model_args(ModelConfig(name="qwen3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                                          ffn_dim=128, vocab_size=256, max_seq_len=32))
UNTIED_QWEN3_ARGS = build_model_args(ModelConfig(name="qwen3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                                 head_dim=32, ffn_dim=128, vocab_size=256, max_seq_len=32,
                                                 tie_embeddings=False))

# (global shape, mesh shape, placements): the shardings FSDP, HSDP, TP and their combinations give a parameter.
LAYOUTS = {
    "fsdp_uneven": ((10, 6), (4,), [Shard(0)]),
    "fsdp_empty_last_rank": ((5, 6), (4,), [Shard(0)]),
    "tp_rowwise": ((6, 10), (4,), [Shard(1)]),
    "vector": ((11,), (3,), [Shard(0)]),
    "hsdp": ((6, 8), (2, 2), [Replicate(), Shard(0)]),
    "fsdp_x_tp_colwise": ((8, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    "fsdp_x_tp_colwise_uneven": ((14, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    "fsdp_x_tp_rowwise": ((6, 10), (2, 2), [Shard(0), Shard(1)]),
    "experts": ((4, 6, 8), (2,), [Shard(0)]),
}


def _dtensor_shard(full: torch.Tensor, mesh_shape, placements, coordinate) -> torch.Tensor:
    """The local tensor DTensor's own placement code cuts from `full` at `coordinate` (left to right)."""
    local = full
    for placement, n, i in zip(placements, mesh_shape, coordinate):
        if not isinstance(placement, Replicate):
            local = placement._split_tensor(local, n, with_padding=False)[0][i]
    return local


def _coordinates(mesh_shape):
    return itertools.product(*[range(n) for n in mesh_shape])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shard_indices_are_the_elements_dtensor_places_there(layout):
    shape, mesh_shape, placements = LAYOUTS[layout]
    full = torch.arange(math.prod(shape)).view(shape)
    for coordinate in _coordinates(mesh_shape):
        indices = init.placement_indices(shape, placements, mesh_shape, coordinate)
        want = _dtensor_shard(full, mesh_shape, placements, coordinate)
        torch.testing.assert_close(full[torch.meshgrid(*indices, indexing="ij")], want, rtol=0, atol=0)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 3 x 4 (and 5 for vectors), so the small shapes above span many tiles and cut through them."""
    monkeypatch.setattr(init, "TILE_ROWS", 3)
    monkeypatch.setattr(init, "TILE_COLS", 4)
    monkeypatch.setattr(init, "TILE_1D", 5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_shard_drawn_alone_equals_that_slice_of_the_whole_parameter(small_tiles, layout):
    shape, mesh_shape, placements = LAYOUTS[layout]
    how = init.trunc_normal(0.02)
    whole = torch.empty(shape)
    init.fill_shard(whole, shape, [torch.arange(n) for n in shape], "layers.0.w", how, seed=3)
    assert whole.std() > 0
    for coordinate in _coordinates(mesh_shape):
        indices = init.placement_indices(shape, placements, mesh_shape, coordinate)
        local = torch.full([len(ix) for ix in indices], float("nan"))
        init.fill_shard(local, shape, indices, "layers.0.w", how, seed=3)
        torch.testing.assert_close(local, whole[torch.meshgrid(*indices, indexing="ij")], rtol=0, atol=0)


def test_drawing_threads_do_not_change_the_values(small_tiles, monkeypatch):
    shape = (10, 9)
    draws = []
    for workers in (1, 3):
        monkeypatch.setattr(init, "draw_workers", lambda workers=workers: workers)
        out = torch.empty(shape)
        init.fill_shard(out, shape, [torch.arange(n) for n in shape], "output.weight", init.trunc_normal(0.1), 1)
        draws.append(out)
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


def test_values_depend_on_the_seed_and_the_name():
    shape = (4, 4)
    draws = {}
    for seed, name in [(1, "a.weight"), (2, "a.weight"), (1, "b.weight")]:
        out = torch.empty(shape)
        init.fill_shard(out, shape, [torch.arange(4), torch.arange(4)], name, init.normal(1.0), seed)
        draws[seed, name] = out
    assert not torch.equal(draws[1, "a.weight"], draws[2, "a.weight"])
    assert not torch.equal(draws[1, "a.weight"], draws[1, "b.weight"])


# 70B Llama 3 parameters on 64 ranks: FSDP 64, and FSDP 8 x TP 8 (colwise w1 / rowwise wo).
SEVENTY_B = {
    "wq_fsdp64": ((8192, 8192), (64,), [Shard(0)], (5,)),
    "embedding_fsdp64": ((128256, 8192), (64,), [Shard(0)], (63,)),
    "w1_fsdp8_tp8": ((28672, 8192), (8, 8), [_StridedShard(0, split_factor=8), Shard(0)], (3, 5)),
    "wo_fsdp8_tp8": ((8192, 8192), (8, 8), [Shard(0), Shard(1)], (7, 2)),
}


@pytest.mark.parametrize("name", list(SEVENTY_B))
def test_a_rank_of_a_70b_run_plans_only_the_tiles_over_its_shard(name):
    shape, mesh_shape, placements, coordinate = SEVENTY_B[name]
    indices = init.placement_indices(shape, placements, mesh_shape, coordinate)
    shard = math.prod(len(ix) for ix in indices)
    drawn = sum(math.prod(tile_shape) for _, tile_shape, _ in init.tile_plan(shape, indices))
    assert shard <= drawn < 2 * shard, f"{name}: draws {drawn} numbers for a shard of {shard}"
    assert drawn < math.prod(shape) / 16


def test_a_sharded_parameter_is_never_drawn_whole(monkeypatch):
    shape, ranks = (1024, 2048), 8
    drawn = []
    real_draw = init.draw_tile

    def recording_draw(how, seed, name, tile, tile_shape):
        drawn.append(tile_shape)
        return real_draw(how, seed, name, tile, tile_shape)

    monkeypatch.setattr(init, "draw_tile", recording_draw)
    indices = init.placement_indices(shape, [Shard(0)], (ranks,), (3,))
    local = torch.empty([len(ix) for ix in indices])
    init.fill_shard(local, shape, indices, "layers.0.attention.wq.weight", init.trunc_normal(0.02), seed=0)
    assert max(math.prod(s) for s in drawn) == init.TILE_ROWS * init.TILE_COLS
    assert sum(math.prod(s) for s in drawn) == local.numel() == math.prod(shape) // ranks


def _model(seed: int = 5, args=ARGS, **kwargs) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=seed, **kwargs)
    return model


def test_the_seed_argument_not_torchs_generator_decides_the_weights():
    torch.manual_seed(1)
    first = _model().state_dict()
    torch.manual_seed(2)
    for key, value in _model().state_dict().items():
        assert torch.equal(value, first[key]), key


@pytest.mark.parametrize("args", [ARGS, UNTIED_QWEN3_ARGS], ids=["llama3", "qwen3_untied"])
def test_pipeline_stages_initialise_to_their_slice_of_the_whole_model(args):
    whole = _model(args=args).state_dict()
    with torch.device("meta"):
        meta = Transformer(args)
    split = split_layers(args.n_layers, 4)  # interleaved: several stages per rank, each keeps global layer ids
    for i, layers in enumerate(split):
        stage = build_stage(meta, layers, is_first=i == 0, is_last=i == len(split) - 1)
        stage.to_empty(device="cpu")
        stage.init_weights(seed=5)
        for key, value in stage.state_dict().items():
            assert torch.equal(value, whole[key]), key


def test_a_tied_model_materialised_from_meta_holds_one_matrix_drawn_once():
    # to_empty gives the embedding and the output projection a new parameter each; init_weights ties them again
    # before drawing, so the one matrix is drawn (as the embedding) once and serves both.
    whole = _model(args=QWEN3_ARGS)
    with torch.device("meta"):
        model = Transformer(QWEN3_ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(list(whole.parameters()))
    for key, value in model.state_dict().items():
        assert torch.equal(value, whole.state_dict()[key]), key


def test_wrapped_blocks_and_pure_bf16_parameters_get_the_same_values():
    whole = _model().state_dict()
    wrapped = Transformer(ARGS)
    apply_activation_checkpointing(wrapped, ActivationCheckpointConfig(mode="full"))
    wrapped.init_weights(seed=5)
    for key, value in wrapped.state_dict().items():
        assert torch.equal(value, whole[key.replace("._checkpoint_wrapped_module", "")]), key
    bf16 = Transformer(ARGS).to(torch.bfloat16)
    bf16.init_weights(seed=5)
    for key, value in bf16.state_dict().items():
        assert torch.equal(value, whole[key].to(torch.bfloat16)), key


def test_a_parameter_without_a_declared_distribution_is_refused():
    model = Transformer(ARGS)
    model.layers["0"].extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"layers\.0\.extra has no initialisation"):
        model.init_weights(seed=0)


def test_init_weights_refuses_to_write_over_an_existing_output(tmp_path, capsys):
    from titan_npu.cli import main

    (tmp_path / "seed").mkdir()
    assert main(["init-weights", "--output", str(tmp_path / "seed")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_init_weights_in_one_process_prints_no_torch_warning(tmp_path):
    """Its output is one line: DCP's 'assuming the intent is to save in a single process' is the intent here."""
    import warnings

    from tiny_run import TINY_RUN

    from titan_npu.cli import main

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["init-weights", *TINY_RUN, "--output", str(tmp_path / "seed")]) == 0
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []

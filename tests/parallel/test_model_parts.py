"""Single-process pieces of the parallel code: the pipeline split, stage placement, activation checkpointing and
compile applied from outside the model (names and numerics unchanged), and one optimizer per pipeline part."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_npu.config.schema import ActivationCheckpointConfig, CompileConfig, ModelConfig
from titan_npu.errors import LayoutError
from titan_npu.models.decoder.pipeline import build_stage, split_layers
from titan_npu.models.llama import Transformer
from titan_npu.models.registry import build_model_args
from titan_npu.parallel.activation_checkpoint import apply_activation_checkpointing, blocks_to_checkpoint
from titan_npu.parallel.compile import apply_compile
from titan_npu.parallel.pipeline import PartOptimizers, build_part_optimizers, stage_ids_for_rank

ARGS = build_model_args(ModelConfig(name="llama3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
                                    max_seq_len=32))
# The same size as Qwen3: q/k norms, head size 32 (not dim / n_heads), the output tied to the embedding.
QWEN3_ARGS = build_model_args(ModelConfig(name="qwen3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                                          ffn_dim=128, vocab_size=256, max_seq_len=32))
UNTIED_QWEN3_ARGS = build_model_args(ModelConfig(name="qwen3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                                 head_dim=32, ffn_dim=128, vocab_size=256, max_seq_len=32,
                                                 tie_embeddings=False))


def tiny_model(seed: int = 0, args=ARGS) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


@pytest.mark.parametrize(("layers", "stages", "expected"), [
    (8, 4, [2, 2, 2, 2]),
    (10, 4, [2, 3, 3, 2]),  # leftovers go to the middle stages
    (5, 2, [3, 2]),  # two stages: the first one takes it
    (7, 4, [2, 2, 2, 1]),  # then the first stage, before the last (which also computes the loss)
    (4, 4, [1, 1, 1, 1]),
])
def test_layers_split_evenly_with_first_and_last_stages_lighter(layers, stages, expected):
    split = split_layers(layers, stages)
    assert [len(s) for s in split] == expected
    assert [i for s in split for i in s] == list(range(layers))


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(LayoutError, match="cannot split 3 layers into 4 pipeline stages"):
        split_layers(3, 4)


def test_interleaved_placement_loops_over_the_ranks():
    assert stage_ids_for_rank(1, 4, 2) == [1, 5]
    assert stage_ids_for_rank(0, 2, 1) == [0]


@pytest.mark.parametrize("args", [ARGS, UNTIED_QWEN3_ARGS], ids=["llama3", "qwen3_untied"])
def test_stages_keep_global_names_and_chain_to_the_whole_model(args):
    model = tiny_model(args=args)
    split = split_layers(args.n_layers, 2)
    first, last = build_stage(model, split[0], True, False), build_stage(model, split[1], False, True)
    assert first.output is None and first.norm is None and last.tok_embeddings is None
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    assert "layers.3.attention.wq.weight" in last.state_dict()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)


def test_selective_checkpointing_picks_every_nth_block():
    ids = ["0", "1", "2", "3"]
    assert blocks_to_checkpoint(ids, ActivationCheckpointConfig(mode="selective", selective_every=2)) == ["1", "3"]
    assert blocks_to_checkpoint(ids, ActivationCheckpointConfig(mode="full")) == ids
    assert blocks_to_checkpoint(ids, ActivationCheckpointConfig(mode="none")) == []
    assert blocks_to_checkpoint(ids, ActivationCheckpointConfig(mode="selective", selective_ops=True)) == ids


def _loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("args", [ARGS, QWEN3_ARGS], ids=["llama3", "qwen3"])
@pytest.mark.parametrize("ac", [
    ActivationCheckpointConfig(mode="full"),
    ActivationCheckpointConfig(mode="selective", selective_every=2),
    ActivationCheckpointConfig(mode="selective", selective_ops=True),
])
def test_activation_checkpointing_keeps_names_and_gradients(ac, args):
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    reference = tiny_model(args=args)
    ref_loss, ref_grads = _loss_and_grads(reference, tokens)
    model = tiny_model(args=args)
    wrapped = apply_activation_checkpointing(model, ac)
    assert wrapped == len(blocks_to_checkpoint(list(model.layers.keys()), ac)) > 0
    assert set(model.state_dict()) == set(reference.state_dict())
    loss, grads = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    grads = {k.replace("._checkpoint_wrapped_module", ""): g for k, g in grads.items()}
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)


def test_compile_keeps_parameter_names():
    model = tiny_model()
    names = list(model.state_dict())
    assert apply_compile(model, CompileConfig(enable=True)) == ARGS.n_layers
    assert list(model.state_dict()) == names


def test_part_optimizers_step_every_part_and_share_the_learning_rate():
    parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    opt = build_part_optimizers(parts, lambda ps: torch.optim.SGD([p for m in ps for p in m.parameters()], lr=1.0))
    assert isinstance(opt, PartOptimizers) and len(opt.optimizers) == 2
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    before = [m.weight.detach().clone() for m in parts]
    for m in parts:
        m(torch.ones(1, 4)).sum().backward()
    opt.step()
    scheduler.step()
    assert all(not torch.equal(b, m.weight) for b, m in zip(before, parts))
    assert [g["lr"] for o in opt.optimizers for g in o.param_groups] == [0.5, 0.5]
    opt.zero_grad()
    assert all(p.grad is None for m in parts for p in m.parameters())
    single = build_part_optimizers(parts[:1], lambda ps: torch.optim.SGD(ps[0].parameters(), lr=1.0))
    assert isinstance(single, torch.optim.SGD)
